#!/usr/bin/env bash
# Second call: 2e9417b ("base") against a21d93a ("new2": the table written on a miss only,
# a free's history entries borrowing the block's frames), six alternated rounds.
exec env B=new2 ROUNDS=6 bash "$(dirname "$0")/ab.sh"
