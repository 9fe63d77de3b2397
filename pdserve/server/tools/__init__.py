r"""Tool calling on /v1/chat/completions: the request's tools and the model's calls (chat.py), over the call
syntaxes of the model families pdserve serves, one module each beside their base (base.py):

- hermes (the default; Qwen2.5, Qwen3, Qwen3-MoE, SmolLM2, Hermes):
  <tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>, any number, text around them
- llama3 (Llama 3.1 - 3.3): the whole output is [<|python_tag|>]{"name": N, "parameters": {...}}
- qwen3_xml (Qwen3.5, Qwen3-Coder, Nemotron 3; qwen_xml.py):
  <tool_call>\n<function=N>\n<parameter=K>\nV\n</parameter>\n</function>\n</tool_call>
- deepseek_v3 (DeepSeek-V3, R1): <｜tool▁calls▁begin｜>, per call
  <｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n```json\n{...}\n```<｜tool▁call▁end｜>, then <｜tool▁calls▁end｜>
- deepseek_v31 (DeepSeek-V3.1): the same, each call <｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>

Each syntax says how a model writes a call, how a call is read out of the text (finished or still growing), the
grammar that forces one, and how a past call is written back. partial_json.py finds where growing JSON ends
(a streamed call's arguments).
"""
