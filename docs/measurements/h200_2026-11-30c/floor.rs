// The churn harness's own cost: the same generator, slots and alloc-or-free choice as
// crates/alloc/examples/churn.rs, with an allocator that hands out a counter.
use std::hint::black_box;
use std::time::Instant;
fn run(live: &mut [Option<u64>], s: &mut u64, next: &mut u64, steps: u64) {
    for _ in 0..steps {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        let slot = (*s % 1024) as usize;
        match live[slot].take() {
            Some(p) => {
                black_box(p);
            }
            None => {
                let size = 512u64 << ((*s >> 40) % 15);
                *next += black_box(size);
                live[slot] = Some(*next);
            }
        }
    }
}
fn main() {
    let mut live = vec![None; 1024];
    let mut s = 88172645463325252u64;
    let mut next = 0u64;
    run(&mut live, &mut s, &mut next, 2_000_000);
    let mut t = Vec::new();
    for _ in 0..5 {
        let st = Instant::now();
        run(&mut live, &mut s, &mut next, 2_000_000);
        t.push(format!("{:.1}", st.elapsed().as_nanos() as f64 / 2e6));
    }
    println!("harness floor ns per operation {}", t.join(" "));
}
