import ctypes, time, os, threading
libc = ctypes.CDLL(None, use_errno=True)
SYS = 324
q = libc.syscall(SYS, 0, 0, 0)
print("query mask", hex(q), "errno", ctypes.get_errno())
r = libc.syscall(SYS, 16, 0, 0)  # REGISTER_PRIVATE_EXPEDITED
print("register", r, ctypes.get_errno())
stop = False
def spin():
    while not stop: pass
ts=[threading.Thread(target=spin) for _ in range(0)]
[t.start() for t in ts]
t0=time.perf_counter(); n=2000
for _ in range(n): libc.syscall(SYS, 8, 0, 0)  # PRIVATE_EXPEDITED
print("private expedited us", (time.perf_counter()-t0)/n*1e6)
stop=True
[t.join() for t in ts]
print(open('/proc/cpuinfo').read().split('model name')[1].split('\n')[0], os.cpu_count(), os.uname().release)
