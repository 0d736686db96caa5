#!/usr/bin/env bash
# Sixth call: call5.sh again (issue 30's table on the bundle at 0a9212d), the host quiet.
exec bash "$(dirname "$0")/call5.sh"
