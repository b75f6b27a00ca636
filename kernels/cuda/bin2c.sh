#!/bin/sh
# bin2c.sh NAME FILE: a C array `NAME` and `NAME_size` holding FILE's bytes.
set -e
name=$1
file=$2
echo "/* generated from $(basename "$file") by bin2c.sh; do not edit */"
echo "#include <stddef.h>"
echo "__attribute__((aligned(16))) const unsigned char ${name}[] = {"
od -An -v -tx1 "$file" | sed -e 's/ *$//' -e 's/ \([0-9a-f][0-9a-f]\)/0x\1,/g'
echo "};"
echo "const size_t ${name}_size = sizeof(${name});"
