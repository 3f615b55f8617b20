#ifndef RPN_H
#define RPN_H

/* Evaluate a space-separated RPN expression; 0 and *out on success, -1 on a malformed expression. */
int rpn_eval(const char *expr, long *out);

#endif
