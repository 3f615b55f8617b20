#include <math.h>

#include "util.h"

double mean(const double *xs, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += xs[i];
    return s / n;
}

double stddev(const double *xs, int n) {
    double m = mean(xs, n), s = 0;
    for (int i = 0; i < n; i++) s += (xs[i] - m) * (xs[i] - m);
    return sqrt(s / n);
}
