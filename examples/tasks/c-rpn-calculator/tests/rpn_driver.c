/* Prints what rpn_eval makes of the expression on stdin: "<return code> <result>", the result left at 777 when
   the expression is rejected. It holds no expected values: the verifier's harness compares what it prints. */
#include <stdio.h>
#include <string.h>

#include "rpn.h"

int main(void) {
    char line[4096];
    size_t n = fread(line, 1, sizeof line - 1, stdin);
    line[n] = '\0';
    long got = 777;
    int rc = rpn_eval(line, &got);
    printf("%d %ld\n", rc, got);
    return 0;
}
