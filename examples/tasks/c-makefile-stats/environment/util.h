#ifndef UTIL_H
#define UTIL_H

double mean(const double *xs, int n);
double stddev(const double *xs, int n);

#endif
