#!/bin/bash
# Copy SRC/*.txt to DEST/*.txt.bak
src=$1
dest=$2
mkdir -p $dest
count=0
for f in $(ls $src/*.txt); do
  cp $f $dest/$(basename $f).bak
  count=$((count + 1))
done
echo "backed up $count file(s)"
