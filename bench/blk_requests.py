#!/usr/bin/env python3
"""What the block layer made of a command's I/O: requests, merges and average request size.

    python3 bench/blk_requests.py --path /var/tmp/tm -- build/default/bin/tiermem-bench nvme \\
        --path /var/tmp/tm --rw read --bs 1M --qd 16 --size 1G --runtime 3

Reads /sys/block/<disk>/stat (the disk holding --path; a partition's parent disk) before and
after the command and prints, for reads and writes: completed requests, merges, bytes, the
average bytes per request (bytes / requests) and bytes per submitted 1 MiB (requests + merges
is what was submitted to the block layer after any splitting). The counters are the whole disk's:
other processes' I/O in the same interval is counted too (run on a quiet machine, or compare
runs of the same length). Exit status: the command's.
"""
import argparse
import os
import subprocess
import sys


def disk_of(path):
    st = os.stat(path)
    node = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if os.path.exists(os.path.join(node, "partition")):
        node = os.path.dirname(node)
    return node


def read_stat(node):
    with open(os.path.join(node, "stat")) as f:
        v = [int(x) for x in f.read().split()]
    # reads: ios, merges, sectors; writes: ios, merges, sectors (sectors are 512 bytes)
    return {"read": (v[0], v[1], v[2] * 512), "write": (v[4], v[5], v[6] * 512)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", required=True, help="a file or directory on the disk to watch")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        ap.error("give the command after --")
    node = disk_of(a.path)
    before = read_stat(node)
    rc = subprocess.call(cmd)
    after = read_stat(node)
    print(f"block requests on {os.path.basename(node)}:")
    for op in ("read", "write"):
        ios, merges, nbytes = (after[op][i] - before[op][i] for i in range(3))
        if ios == 0:
            continue
        print(f"  {op:5}: {ios} requests, {merges} merges, {nbytes / 2**20:.0f} MiB, "
              f"{nbytes / ios / 1024:.0f} KiB per request, {merges / ios:.2f} merges per request")
    sys.exit(rc)


if __name__ == "__main__":
    main()
