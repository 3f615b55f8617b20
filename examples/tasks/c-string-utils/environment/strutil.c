#include <ctype.h>
#include <string.h>

#include "strutil.h"

void str_reverse(char *s) {
    size_t n = strlen(s);
    for (size_t i = 0; i <= n / 2; i++) {
        char t = s[i];
        s[i] = s[n - i];
        s[n - i] = t;
    }
}

size_t str_count(const char *s, char c) {
    size_t count = 0;
    while (*s++) {
        if (*s == c) count++;
    }
    return count;
}

char *str_trim(char *s) {
    char *start = s;
    while (isspace((unsigned char)*start)) start++;
    char *end = s + strlen(s) - 1;
    while (isspace((unsigned char)*end)) end--;
    end[1] = '\0';
    memmove(s, start, end - start + 2);
    return s;
}
