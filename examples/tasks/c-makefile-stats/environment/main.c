#include <stdio.h>
#include <stdlib.h>

#include "util.h"

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: stats N...\n");
        return 2;
    }
    double xs[256];
    int n = 0;
    for (int i = 1; i < argc && n < 256; i++) xs[n++] = atof(argv[i]);
    printf("mean=%.2f sd=%.2f\n", mean(xs, n), stddev(xs, n));
    return 0;
}
