"""A GPT-2 folder as llama.cpp's GGUF file, by llama.cpp's own converter: this file imports
nothing of Octavo's (cpu_peers.py then serves the file with llama-server).

    python llama_cpp.py HF_FOLDER LLAMA_CPP_DIR OUTTYPE OUT.gguf

It runs LLAMA_CPP_DIR/convert_hf_to_gguf.py with its gguf-py (which need torch, transformers
and numpy: the calling python's), OUTTYPE "bf16" or "q8_0". cpu_peers.py's folders carry a
made-up WordLevel tokenizer (id i named "t<i>"), which the converter refuses (an unknown
pre-tokenizer): the vocabulary is written here instead, as GPT-2's BPE model with one merge,
so llama.cpp loads it. Token ids cross as ids, so the vocabulary's content does not matter.
"""

import sys
from pathlib import Path


def convert(folder: str, llama_cpp: str, outtype: str, out: str) -> None:
    sys.path.insert(0, str(Path(llama_cpp) / "gguf-py"))
    sys.path.insert(0, llama_cpp)
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", outtype, "--outfile", out]
    import convert_hf_to_gguf
    import gguf
    from conversion.gpt2 import GPT2Model

    def set_vocab(self) -> None:
        size = self.hparams["vocab_size"]
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("gpt-2")
        self.gguf_writer.add_token_list([f"t{i}" for i in range(size)])
        self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * size)
        self.gguf_writer.add_token_merges(["t 0"])
        self.gguf_writer.add_eos_token_id(size - 1)
        self.gguf_writer.add_bos_token_id(size - 1)

    gguf_parameters = GPT2Model.set_gguf_parameters

    def set_gguf_parameters(self) -> None:  # transformers 5 writes n_positions, not n_ctx
        self.hparams.setdefault("n_ctx", self.hparams["n_positions"])
        gguf_parameters(self)

    GPT2Model.set_vocab = set_vocab
    GPT2Model.set_gguf_parameters = set_gguf_parameters
    convert_hf_to_gguf.main()


def main() -> None:
    convert(*sys.argv[1:5])


if __name__ == "__main__":
    main()
