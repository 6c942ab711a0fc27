"""What waits for another stream's queued work: one stream held back by a sleep (~0.1 s),
then each action on another stream; prints whether the held-back stream had finished when
the action returned (True: the action waited for it). ``python3 tests/gpu/alloc_waits.py``
on a GPU. Made for the guard's fill on a stream of its own (``placement.made_apart``): its
host wait covers the fill alone, unless the allocation needs new device memory."""

import torch

SLEEP = 200_000_000


def held_done_after(action) -> bool:
    held = torch.cuda.Stream()
    with torch.cuda.stream(held):
        torch.cuda._sleep(SLEEP)
    action()
    done = held.query()
    torch.cuda.synchronize()
    return done


other = torch.cuda.Stream()
warm = torch.empty(1 << 20, device="cuda", dtype=torch.int64)
print("nothing:", held_done_after(lambda: None))
print("other stream sync:", held_done_after(lambda: other.synchronize()))


def fresh():
    with torch.cuda.stream(other):
        torch.zeros(1 << 28, device="cuda", dtype=torch.int8)  # 256 MB: a new segment
    other.synchronize()


print("fresh 256 MB allocation on another stream + sync:", held_done_after(fresh))
keep = []


def cached():
    with torch.cuda.stream(other):
        keep.append(torch.zeros(8, device="cuda", dtype=torch.int64))
    other.synchronize()


cached()
print("cached small allocation on another stream + sync:", held_done_after(cached))
s2 = torch.cuda.Stream()


def small_new_stream():
    with torch.cuda.stream(s2):
        keep.append(torch.zeros(8, device="cuda", dtype=torch.int64))
    s2.synchronize()


print("first small allocation on a new stream + sync:", held_done_after(small_new_stream))
