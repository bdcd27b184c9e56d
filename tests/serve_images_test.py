"""Images in chat requests to the policy server, through the official `openai` client: a drawn
image as a base64 data: URL, the answer's log-probs against a teacher-forced forward of the prompt
with its image vectors, and each malformed image part refused in one line naming it."""
import base64

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from dapo_jax import testing
from dapo_jax.data import images as images_lib
from dapo_jax.data import tokenizer as tokenizer_lib
from dapo_jax.model import transformer as model_lib
from dapo_jax.model import vision
from dapo_jax.model.config import ModelConfig, VisionConfig
from dapo_jax.serve import server as server_lib

openai = pytest.importorskip("openai")
MAX_NEW = 6


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("vlm"))
  tok = tokenizer_lib.train_bpe(path, testing.corpus(), vocab_size=300, extra_special=images_lib.IMAGE_TOKENS)
  boi, img, eoi = images_lib.image_token_ids(tok, "test")
  cfg = ModelConfig(vocab_size=len(tok), embed_dim=32, mlp_dim=48, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, arch="gemma3", qk_norm=True, local_layers=(0,), sliding_window=16, query_scale=8.0,
                    vision=VisionConfig(image_size=8, patch_size=2, embed_dim=16, mlp_dim=24, num_layers=1,
                                        num_heads=2, tokens_per_image=4, image_token_id=img, boi_token_id=boi,
                                        eoi_token_id=eoi))
  params = model_lib.init_params(cfg, jax.random.key(0))
  params = jax.tree.map(lambda x: x * 3.0, params)  # images that move the answer
  eos = tokenizer_lib.eos_ids(tok)
  with server_lib.PolicyServer(cfg, params, tok, eos_ids=eos, slots=4, max_prompt_len=96, max_new_tokens=MAX_NEW,
                               max_images=2, logprobs_mode="raw") as s:
    yield cfg, params, tok, s, openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


def drawn(seed: int) -> bytes:
  rng = np.random.default_rng(seed)
  return images_lib.encode_png(Image.fromarray(rng.integers(0, 255, (12, 20, 3), dtype=np.uint8)))


def data_url(png: bytes) -> str:
  return "data:image/png;base64," + base64.b64encode(png).decode()


def message(*images, text="How many red shapes?"):
  parts = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images]
  return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def greedy_reference(cfg, params, tok, images, text, content=None, slots=2):
  """Greedy answer ids and their log-probs by argmax of teacher-forced logits over the rendered prompt
  (`content`, else one mark per image and `text`) with its image vectors, one token at a time (no engine,
  no cache), up to MAX_NEW or an EOS."""
  content = images_lib.IMAGE_MARK * len(images) + text if content is None else content
  rendered = tokenizer_lib.render(tok, [{"role": "user", "content": content}], True)
  ids = tok(images_lib.expand_marks(rendered, tok, cfg.vision, images), add_special_tokens=False)["input_ids"]
  grids = (jnp.asarray(images_lib.batch_grids(cfg.vision, [images], slots)),) if cfg.vision.native_resolution else ()
  feats = vision.image_features(cfg.vision, params["vision"],
                                jnp.asarray(images_lib.batch_pixels(cfg.vision, [images], slots)), *grids)
  eos = tokenizer_lib.eos_ids(tok)
  out, logps = [], []
  for _ in range(MAX_NEW):
    row = np.asarray([ids + out], np.int32)
    z = np.asarray(model_lib.logits(cfg, params, row, np.ones(row.shape, bool), images_BMD=feats), np.float64)[0, -1]
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    out.append(int(np.argmax(z)))
    logps.append(float(logp[out[-1]]))
    if out[-1] in eos:
      return out[:-1], logps[:-1]
  return out, logps


def test_an_image_reaches_the_answer_and_its_log_probs_are_the_forwards(vlm):
  cfg, params, tok, _, client = vlm
  png = drawn(0)
  out = client.chat.completions.create(model="dapo-policy", messages=message(png), temperature=0, logprobs=True,
                                       max_tokens=MAX_NEW)
  want_ids, want_logp = greedy_reference(cfg, params, tok, [png], "How many red shapes?")
  assert len(want_ids) >= 2 and out.choices[0].message.content == tok.decode(want_ids)
  np.testing.assert_allclose([t.logprob for t in out.choices[0].logprobs.content], want_logp, atol=2e-4)
  # Another image: the same question scores otherwise.
  other = client.chat.completions.create(model="dapo-policy", messages=message(drawn(1)), temperature=0,
                                         logprobs=True, max_tokens=MAX_NEW)
  assert [t.logprob for t in other.choices[0].logprobs.content] != [t.logprob for t in out.choices[0].logprobs.content]
  # Two images in one message.
  two = client.chat.completions.create(model="dapo-policy", messages=message(png, drawn(2)), temperature=0,
                                       logprobs=True, max_tokens=MAX_NEW)
  want_ids, want_logp = greedy_reference(cfg, params, tok, [png, drawn(2)], "How many red shapes?")
  assert two.choices[0].message.content == tok.decode(want_ids)
  np.testing.assert_allclose([t.logprob for t in two.choices[0].logprobs.content], want_logp, atol=2e-4)


def test_qwen_vl_images_keep_their_own_sizes_on_the_server(tmp_path):
  """Qwen2.5-VL at native resolution (`native_resolution`): a wide and a square picture in one request take
  their own token counts, and the answer and its log-probs are the teacher-forced forward's."""
  from tests.qwen_vl_native_test import tiny_native_qwen
  tok, cfg = tiny_native_qwen(str(tmp_path))
  vcfg = cfg.vision
  params = jax.tree.map(lambda x: x * 3.0, model_lib.init_params(cfg, jax.random.key(0)))
  wide, square = drawn(0), images_lib.encode_png(Image.new("RGB", (8, 8), (200, 10, 10)))
  assert [images_lib.tokens_per_image(vcfg, images_lib.grid(vcfg, b)) for b in (wide, square)] == [2, 4]
  with server_lib.PolicyServer(cfg, params, tok, eos_ids=tokenizer_lib.eos_ids(tok), slots=2, max_prompt_len=96,
                               max_new_tokens=MAX_NEW, max_images=2, logprobs_mode="raw") as s:
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="dapo-policy", messages=message(wide, square), temperature=0,
                                         logprobs=True, max_tokens=MAX_NEW)
  want_ids, want_logp = greedy_reference(cfg, params, tok, [wide, square], "How many red shapes?")
  assert len(want_ids) >= 2 and out.choices[0].message.content == tok.decode(want_ids)
  np.testing.assert_allclose([t.logprob for t in out.choices[0].logprobs.content], want_logp, atol=2e-4)


def test_the_server_adds_pan_and_scan_crops_when_the_run_does(vlm):
  """`pan_and_scan` (launch.serve: the run's `data.pan_and_scan`): a tall picture's crops follow it, and the
  answer is the greedy one over the prompt `images.pan_and_scan` writes."""
  cfg, params, tok, _, _ = vlm
  rng = np.random.default_rng(5)
  blocks = rng.integers(0, 255, (9, 3, 3), dtype=np.uint8)  # Large flat blocks: a small PNG of 900 x 300.
  tall = images_lib.encode_png(Image.fromarray(np.kron(blocks, np.ones((100, 100, 1), np.uint8))))
  text = "How many red shapes?"
  messages, imgs = images_lib.pan_and_scan([{"role": "user", "content": images_lib.IMAGE_MARK + text}], [tall])
  assert len(imgs) == 4  # The picture and its three crops.
  with server_lib.PolicyServer(cfg, params, tok, eos_ids=tokenizer_lib.eos_ids(tok), slots=2, max_prompt_len=192,
                               max_new_tokens=MAX_NEW, max_images=4, logprobs_mode="raw", pan_and_scan=True) as s:
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="dapo-policy", messages=message(tall, text=text), temperature=0,
                                         logprobs=True, max_tokens=MAX_NEW)
  want_ids, want_logp = greedy_reference(cfg, params, tok, list(imgs), text, messages[0]["content"], slots=4)
  assert out.choices[0].message.content == tok.decode(want_ids)
  np.testing.assert_allclose([t.logprob for t in out.choices[0].logprobs.content], want_logp, atol=2e-4)


@pytest.mark.parametrize("part,match", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     r"messages\[0\]\.content\[0\]\.image_url\.url: expected a data:image/\.\.\.;base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
     r"content\[0\]\.image_url\.url: not base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}},
     r"messages\[0\]\.content\[0\]: not a readable image"),
    ({"type": "input_audio", "input_audio": {}}, r"messages\[0\]\.content\[0\]: expected a text or image_url part"),
])
def test_a_bad_image_part_is_a_400_naming_it(vlm, part, match):
  client = vlm[4]
  with pytest.raises(openai.BadRequestError, match=match):
    client.chat.completions.create(model="dapo-policy", max_tokens=2,
                                   messages=[{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}])


def test_too_many_images_or_a_mark_in_the_text_are_refused(vlm):
  client = vlm[4]
  with pytest.raises(openai.BadRequestError, match=r"3 images; this server takes at most 2"):
    client.chat.completions.create(model="dapo-policy", max_tokens=2, messages=message(drawn(0), drawn(1), drawn(2)))
  with pytest.raises(openai.BadRequestError, match=r"holds 8 image placeholders for 1 image part"):
    client.chat.completions.create(model="dapo-policy", max_tokens=2,
                                   messages=message(drawn(0), text="what is <image>?"))
  # Text alone still answers (zeros for its image slots, never placed).
  out = client.chat.completions.create(model="dapo-policy", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
  assert out.choices[0].finish_reason in ("stop", "length")
