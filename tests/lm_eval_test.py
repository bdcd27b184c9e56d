"""lm-evaluation-harness, unmodified, against the policy server: a multiple-choice task from a local
file scored through `local-completions` (echo + logprobs) gives the accuracy and the per-choice
log-likelihoods that lm-evaluation-harness's own `hf` backend (transformers, torch) gives on the same
exported directory; a generation task through `local-chat-completions` answers as greedy decoding does."""
import json

import numpy as np
import pytest

from dapo_jax import testing
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.hf import convert as hf

QA = [("What is 12 + 5?", ["17", "18", "27", "7"], 0), ("What is 40 + 2?", ["24", "42", "44", "40"], 1),
      ("What is 3 + 4?", ["34", "1", "7", "8"], 2), ("What is 9 + 9?", ["99", "19", "81", "18"], 3),
      ("What is 20 + 30?", ["50", "23", "60", "5"], 0), ("What is 6 + 7?", ["67", "13", "1", "42"], 1)]

TASK = """task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow
def test_local_completions_match_lm_evals_own_hf_backend(tmp_path, monkeypatch):
  lm_eval = pytest.importorskip("lm_eval")
  pytest.importorskip("torch")
  from lm_eval.tasks import TaskManager

  from dapo_jax.serve import server as server_lib
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  model_dir = str(tmp_path / "model")
  tok = tokenizer_lib.train_bpe(model_dir, testing.corpus(), vocab_size=300, chat_template=True)
  # A tiny model that has memorised four of the six answers: accuracy well away from chance and from 1.
  rows = [(tok(f"Question: {q}\nAnswer:", add_special_tokens=False)["input_ids"],
           tok(" " + choices[a], add_special_tokens=False)["input_ids"]) for q, choices, a in QA[:4]]
  cfg = testing.tiny_model_config(vocab_size=len(tok), embed_dim=64, mlp_dim=128)
  params, loss = testing.memorized_model(cfg, rows, steps=150)
  assert loss < 0.05
  hf.save(model_dir, cfg, params, tokenizer=tok)
  data = tmp_path / "mc.jsonl"
  data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QA))
  (tmp_path / "tasks").mkdir()
  (tmp_path / "tasks" / "local_mc.yaml").write_text(TASK.format(data=data))
  tasks = TaskManager(include_path=str(tmp_path / "tasks"))
  run = lambda model, args: lm_eval.simple_evaluate(model=model, model_args=args, tasks=["local_mc"],
                                                    task_manager=tasks, log_samples=True, batch_size=1)
  with server_lib.PolicyServer(cfg, params, tok, eos_ids=tokenizer_lib.eos_ids(tok), slots=8, max_prompt_len=128,
                               max_new_tokens=16) as server:
    ours = run("local-completions", f"model=dapo-policy,base_url={server.url}/v1/completions,tokenizer={model_dir},"
                                    "tokenizer_backend=huggingface,tokenized_requests=True,max_length=128")
  ref = run("hf", f"pretrained={model_dir},dtype=float32,device=cpu")
  acc = [r["results"]["local_mc"]["acc,none"] for r in (ours, ref)]
  assert acc[0] == acc[1] and 0.5 <= acc[0] < 1, acc
  ll = [np.array([[float(resp[0][0]) for resp in s["resps"]] for s in r["samples"]["local_mc"]]) for r in (ours, ref)]
  assert ll[0].shape == (len(QA), 4)
  np.testing.assert_allclose(ll[0], ll[1], atol=1e-4)


GEN_TASK = """task: local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  do_sample: false
  max_gen_toks: 12
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def greedy_ids(cfg, params, ids, eos, steps):
  """Argmax of teacher-forced logits, one token at a time (no cache, no sampler): a run's own greedy answer."""
  from dapo_jax.model import transformer as model_lib
  out = []
  for _ in range(steps):
    row = list(ids) + out
    logits = model_lib.logits(cfg, params, np.asarray([row], np.int32), np.ones((1, len(row)), bool))
    out.append(int(np.argmax(np.asarray(logits)[0, -1])))
    if out[-1] in eos:
      break
  return out


@pytest.mark.slow
def test_a_generation_task_through_local_chat_completions_answers_as_the_runs_own_greedy_decoding(tmp_path,
                                                                                                 monkeypatch):
  """A chat model that memorised four of six training prompts' answers (rendered by its chat template,
  as training rows are): lm-evaluation-harness's `local-chat-completions` with `apply_chat_template`
  sends each question as one user message, and every answer it logs is the model's own greedy
  decoding of that rendered prompt (no instruction added: the server renders what is sent), so its
  exact match is the run's."""
  lm_eval = pytest.importorskip("lm_eval")
  from lm_eval.tasks import TaskManager

  from dapo_jax.serve import server as server_lib
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  model_dir = str(tmp_path / "model")
  tok = tokenizer_lib.train_bpe(model_dir, testing.corpus(), vocab_size=300, chat_template=True)
  eos = tokenizer_lib.eos_ids(tok)
  questions = [f"{q} End with: Answer: <number>" for q, _, _ in QA]
  answers = [f"Answer: {choices[a]}" for _, choices, a in QA]
  chat_ids = lambda q: tok(tokenizer_lib.render(tok, [{"role": "user", "content": q}], True),
                           add_special_tokens=False)["input_ids"]
  rows = [(chat_ids(q), tok(a, add_special_tokens=False)["input_ids"] + [eos[0]])
          for q, a in zip(questions[:4], answers[:4])]
  cfg = testing.tiny_model_config(vocab_size=len(tok), embed_dim=64, mlp_dim=128)
  params, loss = testing.memorized_model(cfg, rows, steps=200)
  assert loss < 0.05
  data = tmp_path / "gen.jsonl"
  data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in zip(questions, answers)))
  (tmp_path / "tasks").mkdir()
  (tmp_path / "tasks" / "local_gen.yaml").write_text(GEN_TASK.format(data=data))
  with server_lib.PolicyServer(cfg, params, tok, eos_ids=eos, slots=8, max_prompt_len=128, max_new_tokens=16) as server:
    out = lm_eval.simple_evaluate(
        model="local-chat-completions", model_args=f"model=dapo-policy,base_url={server.url}/v1/chat/completions,"
        "num_concurrent=1,max_retries=1", tasks=["local_gen"], log_samples=True, apply_chat_template=True,
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")))
  samples = sorted(out["samples"]["local_gen"], key=lambda s: s["doc_id"])
  theirs = [s["resps"][0][0] for s in samples]
  ours = [tok.decode([t for t in greedy_ids(cfg, params, chat_ids(q), eos, 12) if t not in eos],
                     skip_special_tokens=True) for q in questions]
  assert theirs == ours
  assert out["results"]["local_gen"]["exact_match,none"] == np.mean([o == a for o, a in zip(ours, answers)]) >= 4 / 6
