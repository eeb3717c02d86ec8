"""Random-weight Hugging Face checkpoints, for tests and benchmarks where no real model is at hand.

The weights are drawn with a larger spread than transformers' initializer so that the logits are
decisive: greedy tokens of a random model then do not hinge on rounding in the last bit, and exactness
tests compare real decisions rather than ties.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def make_random_checkpoint(out_dir: Path, architecture: str = "llama", seed: int = 0,
                           weight_std: float = 0.15, dtype: torch.dtype = torch.float32,
                           **config_fields: Any) -> Path:
    """Write config.json, model.safetensors, generation_config.json and a byte-level tokenizer.

    `config_fields` override the small defaults (hidden_size=64, 2 layers, 4 heads, 2 KV heads,
    vocab 512). Returns `out_dir`.
    """
    import transformers

    fields: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0, rms_norm_eps=1e-5)
    fields.update(config_fields)
    config_class = getattr(transformers, ARCHITECTURES[architecture].replace("ForCausalLM", "Config"))
    config = config_class(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[architecture])(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, weight_std)
    model.to(dtype).save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    make_byte_tokenizer(int(fields["vocab_size"])).save_pretrained(out_dir)
    return out_dir


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def make_byte_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer with <pad>=0, <s>=1, </s>=2, trained on nothing (bytes + merges none).

    Ids past the 256 bytes + 3 specials stay unused by the tokenizer but valid for the model.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: index for index, token in enumerate(specials + sorted(byte_alphabet))}
    filler = vocab_size - len(vocab)
    if filler < 0:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(vocab)} byte tokens")
    for index in range(filler):
        vocab[f"<unused_{index}>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", chat_template=CHAT_TEMPLATE)
