"""Model definitions. Parallelism lives in `layers`; `llama` reads like a textbook transformer."""
