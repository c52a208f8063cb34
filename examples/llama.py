"""A Llama-style decoder built by Hugging Face ``transformers`` from a config alone (no weights downloaded):
the factory named by ``parameters/llama7b_8gpu.yaml`` (``model: examples.llama:llama``).

The defaults are Llama-2 7B's shape: 32 layers, hidden 4096, 32 heads, MLP 11008, vocabulary 32000
(6,738,415,616 parameters). Needs ``pip install transformers``.
"""

from __future__ import annotations


def llama(hidden_size: int = 4096, intermediate_size: int = 11008, heads: int = 32, kv_heads: int = 32,
          layers: int = 32, vocab_size: int = 32000, max_positions: int = 4096):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden_size, intermediate_size=intermediate_size, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, num_hidden_layers=layers, vocab_size=vocab_size,
                         max_position_embeddings=max_positions)
    return LlamaForCausalLM(config)
