#!/bin/bash
cat > /app/Makefile <<'EOF'
CC = gcc
CFLAGS = -std=c11 -Wall -O2
LDLIBS = -lm
OBJS = main.o util.o

stats: $(OBJS)
	$(CC) $(CFLAGS) -o stats $(OBJS) $(LDLIBS)

main.o: main.c util.h
util.o: util.c util.h

%.o: %.c
	$(CC) $(CFLAGS) -c $<

clean:
	rm -f stats $(OBJS)

.PHONY: clean
EOF
