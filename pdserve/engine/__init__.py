"""The inference engine: sequences, KV cache, scheduler, model runner, sampler."""
