#include <stdio.h>
#include <string.h>

#include "strutil.h"

static int failures = 0;
#define CHECK(cond) do { if (!(cond)) { printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); failures++; } } while (0)

int main(void) {
    char a[] = "hello", b[] = "", c[] = "x", d[] = "ab";
    str_reverse(a); CHECK(strcmp(a, "olleh") == 0);
    str_reverse(b); CHECK(strcmp(b, "") == 0);
    str_reverse(c); CHECK(strcmp(c, "x") == 0);
    str_reverse(d); CHECK(strcmp(d, "ba") == 0);

    CHECK(str_count("banana", 'a') == 3);
    CHECK(str_count("banana", 'b') == 1);
    CHECK(str_count("", 'a') == 0);
    CHECK(str_count("aaa", 'a') == 3);

    char t1[] = "  hi there \t\n", t2[] = "     ", t3[] = "", t4[] = "x", t5[] = "\tab";
    CHECK(strcmp(str_trim(t1), "hi there") == 0);
    CHECK(strcmp(str_trim(t2), "") == 0);
    CHECK(strcmp(str_trim(t3), "") == 0);
    CHECK(strcmp(str_trim(t4), "x") == 0);
    CHECK(strcmp(str_trim(t5), "ab") == 0);
    CHECK(str_trim(t5) == t5);
    if (failures == 0) printf("all tests passed\n");
    return failures != 0;
}
