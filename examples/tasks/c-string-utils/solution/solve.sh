#!/bin/bash
cat > /app/strutil.c <<'EOF'
#include <ctype.h>
#include <string.h>

#include "strutil.h"

void str_reverse(char *s) {
    size_t n = strlen(s);
    for (size_t i = 0; i < n / 2; i++) {
        char t = s[i];
        s[i] = s[n - 1 - i];
        s[n - 1 - i] = t;
    }
}

size_t str_count(const char *s, char c) {
    size_t count = 0;
    for (; *s; s++) {
        if (*s == c) count++;
    }
    return count;
}

char *str_trim(char *s) {
    char *start = s;
    while (*start && isspace((unsigned char)*start)) start++;
    size_t len = strlen(start);
    while (len > 0 && isspace((unsigned char)start[len - 1])) len--;
    memmove(s, start, len);
    s[len] = '\0';
    return s;
}
EOF
