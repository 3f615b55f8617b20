/* Prints what the string functions make of fixed inputs, one line each, for the function named on the command
   line. It holds no expected values: the verifier's harness compares what it prints. */
#include <stdio.h>
#include <string.h>

#include "strutil.h"

int main(int argc, char **argv) {
    const char *what = argc > 1 ? argv[1] : "";
    if (strcmp(what, "reverse") == 0) {
        char a[] = "hello", b[] = "", c[] = "x", d[] = "ab";
        char *all[] = {a, b, c, d};
        for (int i = 0; i < 4; i++) {
            str_reverse(all[i]);
            printf("[%s]\n", all[i]);
        }
    } else if (strcmp(what, "count") == 0) {
        printf("%d %d %d %d\n", (int)str_count("banana", 'a'), (int)str_count("banana", 'b'),
               (int)str_count("", 'a'), (int)str_count("aaa", 'a'));
    } else if (strcmp(what, "trim") == 0) {
        char t1[] = "  hi there \t\n", t2[] = "     ", t3[] = "", t4[] = "x", t5[] = "\tab";
        char *all[] = {t1, t2, t3, t4};
        for (int i = 0; i < 4; i++) printf("[%s]\n", str_trim(all[i]));
        char *r = str_trim(t5);
        printf("[%s] %s\n", r, r == t5 ? "in place" : "moved");
    } else {
        return 2;
    }
    return 0;
}
