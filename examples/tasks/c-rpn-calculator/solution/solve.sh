#!/bin/bash
cat > /app/rpn.c <<'EOF'
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "rpn.h"

#define MAX_TOKENS 256

int rpn_eval(const char *expr, long *out) {
    long stack[MAX_TOKENS];
    int top = 0;
    const char *p = expr;
    while (*p) {
        while (*p == ' ') p++;
        if (!*p) break;
        const char *start = p;
        while (*p && *p != ' ') p++;
        size_t len = (size_t)(p - start);
        if (len == 1 && strchr("+-*/", *start)) {
            if (top < 2) return -1;
            long b = stack[--top], a = stack[--top];
            switch (*start) {
                case '+': stack[top++] = a + b; break;
                case '-': stack[top++] = a - b; break;
                case '*': stack[top++] = a * b; break;
                default:
                    if (b == 0) return -1;
                    stack[top++] = a / b;
            }
            continue;
        }
        char buf[64];
        if (len >= sizeof buf || top >= MAX_TOKENS) return -1;
        memcpy(buf, start, len);
        buf[len] = '\0';
        char *end;
        errno = 0;
        long v = strtol(buf, &end, 10);
        if (*end || errno) return -1;
        stack[top++] = v;
    }
    if (top != 1) return -1;
    *out = stack[0];
    return 0;
}
EOF
