# What ran on the H200 for pages.txt (from the repository root, target/ab carried): the
# churn example pinned to core 3, five configurations interleaved, six rounds.
cd target/ab
for r in 1 2 3 4 5 6; do
  for conf in "" "expandable_segments:True,expandable_segments_page_mb:2" "expandable_segments:True,expandable_segments_reclaim:True,expandable_segments_page_mb:2" "expandable_segments:True,expandable_segments_reclaim:True" "ferrocuda_recommended:True"; do
    taskset -c 3 ./churn "$conf" 2000000 3
  done
done
