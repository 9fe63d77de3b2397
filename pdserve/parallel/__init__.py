"""Tensor and pipeline parallelism across the ranks of one instance.

    state.py           ParallelState (TP-minor rank layout), the process groups, control bytes between ranks
    shm_all_reduce.py  the TP group's all-reduce through shared memory on CPU (above models/ and kv_transfer/:
                       it runs the native kernel library's reduction over a shared segment)
"""
