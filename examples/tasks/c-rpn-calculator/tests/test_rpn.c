#include <stdio.h>

#include "rpn.h"

static int failures = 0;

static void ok(const char *e, long want) {
    long got = 12345;
    int rc = rpn_eval(e, &got);
    if (rc != 0 || got != want) { printf("FAIL \"%s\": rc=%d got=%ld want=%ld\n", e, rc, got, want); failures++; }
}

static void bad(const char *e) {
    long got = 777;
    int rc = rpn_eval(e, &got);
    if (rc != -1 || got != 777) { printf("FAIL \"%s\" should be rejected (rc=%d)\n", e, rc); failures++; }
}

int main(void) {
    ok("3 4 +", 7);
    ok("5 1 2 + 4 * + 3 -", 14);
    ok("-3 4 *", -12);
    ok("7 -2 /", -3);
    ok("42", 42);
    ok("  2   3   -  ", -1);
    ok("100 7 / 3 *", 42);
    bad("");
    bad("1 +");
    bad("1 2");
    bad("4 0 /");
    bad("2 x +");
    bad("1 2 ^");
    bad("3 -");
    if (failures == 0) printf("all tests passed\n");
    return failures != 0;
}
