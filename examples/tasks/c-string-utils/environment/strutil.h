#ifndef STRUTIL_H
#define STRUTIL_H
#include <stddef.h>

void str_reverse(char *s);
size_t str_count(const char *s, char c);
char *str_trim(char *s);

#endif
