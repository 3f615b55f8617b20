#include "rpn.h"

int rpn_eval(const char *expr, long *out) {
    (void)expr;
    (void)out;
    return -1; /* TODO: implement */
}
