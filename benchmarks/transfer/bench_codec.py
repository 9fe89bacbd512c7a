"""The rank-exchange codec against pickle, side by side in one process (not a test).

``Platform.all_gather_object`` carries plain data in ``dcp_platform.codec.pack``/``unpack``
(never pickle). This prints, for a load's largest exchange (every rank's wants: one record
of name, offsets, sizes, dtype and flags per tensor it holds), the CPU time of encoding
one rank's payload and decoding it (each rank decodes every rank's), best of several, for
pickle and for the codec, and their ratio.

    python benchmarks/transfer/bench_codec.py [--tensors 300,3000,20000]
"""

from __future__ import annotations

import argparse
import pickle
import time

from dcp_platform.codec import pack, unpack


def _payload(n: int) -> tuple:
    wants = [(f"model.layers.{i}.mlp.weight", (i * 128, 0), (128, 4096), "torch.bfloat16", 3, True, None, [1, 2])
             for i in range(n)]
    return (wants, (1 << 26, 4, False), "host-a", ("0123456789abcdef", "/ckpt/step-1000"))


def _best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", default="300,3000,20000")
    args = ap.parse_args()
    for n in (int(x) for x in args.tensors.split(",")):
        value, repeats = _payload(n), max(3, 3000 // n)
        raw_p, raw_c = pickle.dumps(value, protocol=5), pack(value)
        assert unpack(raw_c, source="rank 0") == value
        p_enc = _best_ms(lambda: pickle.dumps(value, protocol=5), repeats)  # noqa: B023
        p_dec = _best_ms(lambda: pickle.loads(raw_p), repeats)  # noqa: B023, S301 - our own bytes
        c_enc = _best_ms(lambda: pack(value), repeats)  # noqa: B023
        c_dec = _best_ms(lambda: unpack(raw_c, source="rank 0"), repeats)  # noqa: B023
        print(f"{n:>6} tensors: pickle {p_enc:7.2f} ms encode {p_dec:7.2f} ms decode ({len(raw_p)} B); "
              f"codec {c_enc:7.2f} / {c_dec:7.2f} ms ({len(raw_c)} B); codec / pickle {c_enc / p_enc:.1f} x encode, "
              f"{c_dec / p_dec:.1f} x decode")


if __name__ == "__main__":
    main()
