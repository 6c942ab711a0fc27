"""Mutations that compute a row's address in 32 bits, each with the tests that must catch it:
``python3 tests/gpu/large_address_mutations.py NAME`` from the repository root, on a GPU with
the memory for rows ``2**31`` elements apart, applies mutation NAME (``scatter_rows``,
``scatter_capped``: a pool row's start truncated to int32 in that scatter kernel, in
``capped`` its head tiles; ``plan_seed``: the seed's ``req_to_token`` row truncated in the
fixed-block plan kernel), runs ``tests/test_large_address_properties.py`` and
``tests/test_large_addresses.py`` under the ``gpu`` hypothesis profile for at most 150 s,
prints the outcome (failures are the expected one) and restores the file. Where such rows do
not fit (a CPU, a small GPU), those tests skip or use small strides, and nothing wraps."""

import os
import sys

from _mutate import mutate

MUTATIONS = {
    "scatter_rows": (
        "kernels/scatter_rows.py",
        "out = pool_out_ptr + row * pool_stride0",
        "out = pool_out_ptr + (row * pool_stride0).to(tl.int32)",
    ),
    "scatter_capped": (
        "kernels/scatter_capped.py",
        "dst = pool_out_ptr + row * pool_stride0  #",
        "dst = pool_out_ptr + (row * pool_stride0).to(tl.int32)  #",
    ),
    "plan_seed": (
        "kernels/plan_offsets.py",
        "req_to_token_ptr + pool_idx * req_to_token_stride0 + prefix - 1",
        "req_to_token_ptr + (pool_idx * req_to_token_stride0).to(tl.int32) + prefix - 1",
    ),
}
if __name__ == "__main__":
    os.environ["HYPOTHESIS_PROFILE"] = "gpu"
    path, old, new = MUTATIONS[sys.argv[1]]
    tests = ["tests/test_large_address_properties.py", "tests/test_large_addresses.py"]
    mutate(path, old, new, [*tests, "-x", "-rs"], timeout=150)
