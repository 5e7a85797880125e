"""Stays, files, returns and descents of a followed call (gdb_follow.py's JSON).

A stay is a run of consecutive lines in one file; a return is a stay in a file the call had
already left; a descent is a stay in a lower layer of csrc than the stay before it (layers
in the order of docs/architecture.md: common, algo, runtime, host, net, device, cuda, emu,
python)."""

import json
import sys

LAYERS = ("common", "algo", "runtime", "host", "net", "device", "cuda", "emu", "python")


def summary(where):
    stays = []
    for path, _ in where:
        if not stays or stays[-1] != path:
            stays.append(path)
    layer = [LAYERS.index(p.split("/", 1)[0]) for p in stays]
    returns = sum(1 for i, p in enumerate(stays) if p in stays[:i])
    descents = sum(1 for a, b in zip(layer, layer[1:]) if b < a)
    return stays, returns, descents


def main():
    with open(sys.argv[1]) as f:
        where = json.load(f)["where"]
    stays, returns, descents = summary(where)
    print(
        f"{len(stays)} stays in {len(set(stays))} files, {returns} returns to a file already "
        f"left, {descents} descents to a lower layer"
    )
    print("  " + " > ".join(stays))


if __name__ == "__main__":
    main()
