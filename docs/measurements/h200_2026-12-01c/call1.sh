#!/usr/bin/env bash
# First call: 2e9417b (the session's start, "base") against 184596d ("new": the table of
# recent allocations written at every allocation, a vector bin's emptiness, plain rounding
# without the divisions table), six alternated rounds (ab.sh; its output files were then
# named ab_new.txt and ex_new.txt).
exec env ROUNDS=6 bash "$(dirname "$0")/ab.sh"
