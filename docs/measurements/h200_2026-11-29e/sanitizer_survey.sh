# Per-test compute-sanitizer memcheck survey: prints "binary test errors kinds" for each test with errors.
S=/usr/local/cuda/bin/compute-sanitizer
for t in "$@"; do
  for n in $(./$t --list --include-ignored 2>/dev/null | sed -n 's/: test$//p' | grep -v '^fake::'); do
    timeout 90 $S --tool memcheck --leak-check full --print-limit 50 ./$t --exact "$n" --include-ignored --test-threads=1 > /tmp/l 2>&1
    rc=$?
    e=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) error.*/\1/p' /tmp/l | tail -1)
    if [ "${e:-x}" != 0 ] || [ $rc != 0 ]; then
      k=$(grep -E "^========= " /tmp/l | grep -vE "^========= +(at|Host Frame|Saved host|by thread|Address)|COMPUTE-SANITIZER|^========= *$" | sed -E 's/ due to "[^"]*"//; s/0x[0-9a-f]+/ADDR/g' | sort | uniq -c | sed 's/^ *//' | head -8 | tr '\n' ';')
      echo "$t $n rc=$rc errors=${e:-?} $k"
    fi
  done
done
