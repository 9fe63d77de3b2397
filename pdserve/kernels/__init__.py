"""Native kernels: the C library (`csrc/`, built and loaded by `cpu`), its one-call decode step
(`stage_decoder`), the recurrent mixers (`recurrent`) and bf16 GEMM (`gemm`), the Triton kernels of CUDA steps
(`triton_*`), the FP8 KV quantization (`kv_quant`), and the per-machine choice between each kernel and the
PyTorch path it replaces (`dispatch`)."""
