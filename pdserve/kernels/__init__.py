"""Native kernels, the ground floor under `models/`, `parallel/` and `engine/`: a model says what it computes,
a kernel how fast. The C library (`csrc/`, built and loaded by `cpu`), its one-call decode step
(`stage_decoder`), the recurrent mixers (`recurrent`) and bf16 GEMM (`gemm`), the Triton kernels of CUDA steps
(`triton_*`), the FP8 KV quantization (`kv_quant`), and the per-machine choice between each kernel and the
PyTorch path it replaces (`dispatch`, handed those paths by its caller). Nothing here imports a model."""
