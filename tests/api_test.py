"""The Python API (`dapo_jax.Run`): train in pieces, evaluate, sample, export; checked against the
loop's own records, teacher-forced argmax and transformers."""
import json
import os

import numpy as np
import pytest

import dapo_jax


def test_load_config_applies_overrides_and_names_a_bad_one():
  cfg = dapo_jax.load_config("configs/default.py:runlocal", **{"train.num_steps": 3})
  assert cfg.train.num_steps == 3 and cfg.model.embed_dim == 32
  from dapo_jax.builders import ConfigError
  with pytest.raises(ConfigError, match="names no config field"):
    dapo_jax.load_config("configs/default.py", **{"train.num_stepz": 3})
  with pytest.raises(ConfigError, match="'configs/nope.py' not found"):
    dapo_jax.load_config("configs/nope.py")


@pytest.mark.slow
def test_run_trains_in_pieces_samples_greedily_and_exports(tmp_path):
  torch = pytest.importorskip("torch")
  from transformers import AutoModelForCausalLM, AutoTokenizer
  workdir = str(tmp_path / "run")
  overrides = {"train.num_steps": 2, "reward.fn": "dapo_jax.testing:length_reward", "reward.workers": 1}
  with dapo_jax.Run("configs/default.py:runlocal", workdir=workdir, **overrides) as run:
    first = run.train(until_step=1)
    last = run.train()   # goes on from step 1 to train.num_steps
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      steps = [json.loads(line)["step"] for line in f if "rollout/samples" in line]
    assert steps == [1, 2] and first and last
    assert "val/acc/greedy" in run.evaluate()
    texts = run.sample(["What is 3+4?", "What is 12+5?"], k=2, temperature=0.0, max_new_tokens=6, raw=True)
    assert len(texts) == 2 and all(len(t) == 2 and t[0] == t[1] for t in texts)   # greedy: k equal answers
    out = run.export(str(tmp_path / "exported"))
  # The exported model, decoded greedily by transformers from the same prompt tokens, says the same.
  tok = AutoTokenizer.from_pretrained(out)
  model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  for question, (text, _) in zip(["What is 3+4?", "What is 12+5?"], texts):
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
      gen = model.generate(**ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
    want = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text == want, (text, want)
  assert np.isfinite(last["critic/score/mean"])
