"""A small OpenAI-compatible completion server for a local causal LM: the served judge's test server.

It answers the fields the served judge reads, as the real servers document them:

* ``GET /v1/models`` (the model id), ``GET /version``;
* ``POST /v1/completions`` (OpenAI / vLLM): ``prompt`` as text or token ids, ``max_tokens`` greedy
  tokens, ``logprobs: k`` -> ``choices[0].logprobs.top_logprobs[0]`` (the k most likely first tokens),
  vLLM's ``logprob_token_ids`` (those ids' log-probabilities whatever their rank) and
  ``return_tokens_as_token_ids`` (keys ``token_id:N``), and vLLM's ``prompt_logprobs: k`` ->
  ``choices[0].prompt_logprobs``: one entry per prompt token, ``None`` for the first (nothing predicts it),
  then ``{"<id>": {"logprob", "rank", "decoded_token"}}`` for the prompt token and the k most likely;
* ``POST /generate`` (SGLang): ``input_ids``, ``sampling_params.max_new_tokens``, ``return_logprob`` with
  ``token_ids_logprob`` -> ``meta_info.output_token_ids_logprobs[0]`` = ``[[logprob, id, None], ...]``;
  ``return_logprob`` with ``logprob_start_len: s`` (-1: the last prompt token) ->
  ``meta_info.input_token_logprobs`` = ``[[None, ids[s], None], [logprob, ids[s+1], None], ...]`` (SGLang
  always pads the first entry with ``None``) and ``meta_info.output_token_logprobs``.

* with ``routes`` naming them, the label-probability routes, each in the shape of the server's source:
  ``POST /generative_scoring`` (``generative_scoring``, vLLM 0.32: ``query`` + ``items`` token ids,
  ``label_token_ids``, ``apply_softmax`` -> ``data[i].score``, the first label's probability), ``POST
  /v1/systemone`` (``systemone``, vLLM 0.32's structured decisions), ``POST /v1/decisions`` in OpenAI's
  Decisions shape (``decisions``, vLLM 0.33) or in SGLang 0.5's (``sglang_decisions``). The decision routes
  render their prompt as those servers do (the chat template over ``state`` + the question, options
  labelled ``A``, ``B``... one per line, "Answer with the letter of one option only.") and answer the
  options' probabilities renormalized over the labels and ``label_mass``, their full-vocabulary sum.

``routes`` limits what it answers (a route it lacks is a 404), ``logprobs=False`` makes it a server that
returns text only (as some hosted reasoning models do), and ``api_key`` makes every route answer 401 to a
request without the header ``Authorization: Bearer <api_key>`` (as a hosted API does). Log-probabilities
are a float32 log-softmax of the model's next-token logits. One request runs at a time (a lock): a test and
bench server, not a product.
Run it with ``python -m judgeloop.testing.openai_compat MODEL --port 8000 [--api-key-env VAR]``.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch


class LocalModel:
    """A causal LM and its tokenizer behind a lock: next-token log-probabilities of a prompt."""

    def __init__(self, name: str, model: Any = None, tokenizer: Any = None):
        from judgeloop.models import load_causal_lm, load_tokenizer

        self.name = name
        self.model = (model if model is not None else load_causal_lm(name, dtype="float32")).eval()
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(name)
        self.lock = threading.Lock()

    def next_logprobs(self, ids: list[int]) -> torch.Tensor:
        """(V,) float32 log-probabilities of the token after ``ids``."""
        with self.lock, torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1]
            return logits.float().log_softmax(-1)

    def prompt_logprobs(self, ids: list[int]) -> torch.Tensor:
        """(T - 1, V) float32 log-probabilities of each prompt position's next token: row ``t`` is the
        distribution of ``ids[t + 1]`` given ``ids[: t + 1]``."""
        with self.lock, torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0, :-1]  # (T - 1, V)
            return logits.float().log_softmax(-1)

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """``n`` greedy tokens after ``ids`` and the first position's (V,) log-probabilities."""
        first = self.next_logprobs(ids)
        out = [int(first.argmax())]
        while len(out) < n:
            out.append(int(self.next_logprobs(ids + out).argmax()))
        return out, first


class Handler(BaseHTTPRequestHandler):
    """The routes; the server object carries ``lm``, ``routes`` and ``logprobs``."""

    server: Any

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        """Quiet: a test server logs nothing per request."""

    def _send(self, code: int, body: Any, headers: dict[str, str] | None = None) -> None:
        raw = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(raw)

    def fault(self) -> bool:
        """Hook for scripted faults (tests): answer the request here and return True. Default: none."""
        return False

    def refused(self) -> bool:
        """Answer 401 and return True when the server has a key and the request does not carry it."""
        key = self.server.api_key
        if not key or hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {key}"):
            return False
        self._send(401, {"error": {"message": "invalid API key", "type": "invalid_request_error"}})
        return True

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.refused():
            return
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.server.lm.name, "object": "model"}]})
        elif self.path == "/version":
            info = {"version": "judgeloop-openai-compat", "routes": sorted(self.server.routes)}
            info["max_logprobs"] = len(self.server.lm.tokenizer)  # top_logprobs may ask for every token
            self._send(200, info)
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        with self.server.count_lock:  # the requests answered (a refused one too), for tests and benchmarks
            self.server.requests += 1
        if self.refused():
            return
        if self.fault():
            return
        paths = {
            "/v1/completions": ("completions",),
            "/generate": ("sglang",),
            "/generative_scoring": ("generative_scoring",),
            "/v1/systemone": ("systemone",),
            "/v1/decisions": ("decisions", "sglang_decisions"),
        }
        route = next((r for r in paths.get(self.path, ()) if r in self.server.routes), None)
        if route is None:
            self._send(404, {"error": f"no route {self.path}"})
            return
        answer = {
            "completions": self._completions,
            "sglang": self._generate,
            "generative_scoring": self._scoring,
            "systemone": self._systemone,
            "decisions": self._openai_decisions,
            "sglang_decisions": self._sglang_decisions,
        }[route]
        try:
            self._send(200, answer(body))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            self._send(400, {"error": f"bad request: {err}"})

    def _ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.server.lm.tokenizer.encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def _key(self, tid: int, as_ids: bool) -> str:
        return f"token_id:{tid}" if as_ids else self.server.lm.tokenizer.decode([tid])

    def _completions(self, body: dict[str, Any]) -> dict[str, Any]:
        lm = self.server.lm
        ids = self._ids(body["prompt"])
        out, first = lm.greedy(ids, max(1, int(body.get("max_tokens", 16))))
        choice: dict[str, Any] = {"index": 0, "text": lm.tokenizer.decode(out), "finish_reason": "length"}
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        if self.server.logprobs and (body.get("logprobs") or body.get("logprob_token_ids")):
            if body.get("logprob_token_ids"):
                tops = {self._key(int(t), as_ids): float(first[int(t)]) for t in body["logprob_token_ids"]}
            else:
                vals, idx = first.topk(int(body["logprobs"]))
                tops = {self._key(int(t), as_ids): float(v) for v, t in zip(vals, idx)}
            choice["logprobs"] = {
                "tokens": [self._key(out[0], as_ids)],
                "token_logprobs": [float(first[out[0]])],
                "top_logprobs": [tops],
                "text_offset": [0],
            }
        else:
            choice["logprobs"] = None
        if self.server.logprobs and body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(ids, int(body["prompt_logprobs"]))
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out)}
        return {"object": "text_completion", "model": lm.name, "choices": [choice], "usage": usage}

    def _generate(self, body: dict[str, Any]) -> dict[str, Any]:
        lm = self.server.lm
        params = body.get("sampling_params", {})
        ids = self._ids(body["input_ids"] if "input_ids" in body else body["text"])
        out, first = lm.greedy(ids, max(1, int(params.get("max_new_tokens", 16))))
        meta: dict[str, Any] = {"prompt_tokens": len(ids), "completion_tokens": len(out)}
        if self.server.logprobs and body.get("return_logprob") and body.get("token_ids_logprob"):
            meta["output_token_ids_logprobs"] = [
                [[float(first[int(t)]), int(t), None] for t in body["token_ids_logprob"]]
            ]
        if self.server.logprobs and body.get("return_logprob"):
            start = int(body.get("logprob_start_len", -1))
            start = len(ids) - 1 if start < 0 else min(start, len(ids) - 1)
            entries: list[list[Any]] = [[None, ids[start], None]]  # SGLang pads the first with None
            if start < len(ids) - 1:
                rows = lm.prompt_logprobs(ids)  # (T - 1, V)
                entries += [[float(rows[t - 1, ids[t]]), ids[t], None] for t in range(start + 1, len(ids))]
            meta["input_token_logprobs"] = entries
            meta["output_token_logprobs"] = [[float(first[out[0]]), out[0], None]]
        return {"text": lm.tokenizer.decode(out), "meta_info": meta}

    def _scoring(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM 0.32's ``/generative_scoring`` over token ids: each item appended to the query."""
        lm, labels = self.server.lm, [int(t) for t in body["label_token_ids"]]
        if not labels or any(not 0 <= t < len(lm.tokenizer) for t in labels):
            raise ValueError(f"label_token_ids {labels}")
        data, used = [], 0
        for i, item in enumerate(body["items"]):
            ids = [int(t) for t in body["query"]] + [int(t) for t in item]
            lp = lm.next_logprobs(ids)[labels].double()
            p = lp.softmax(-1) if body.get("apply_softmax", True) else lp.exp()
            data.append({"index": i, "object": "score", "score": float(p[0])})
            used += len(ids)
        return {"object": "list", "model": lm.name, "data": data, "usage": {"prompt_tokens": used}}

    def _read(self, state: str, instructions: str, options: list[str]) -> tuple[list[float], float]:
        """One choice question as the decision servers ask it: the options' probabilities over their labels
        (``A``, ``B``, ...) at the reply's first token, and the labels' full-vocabulary mass."""
        lm = self.server.lm
        lines = [f"Question: {instructions}", *(f"{chr(65 + i)}: {o}" for i, o in enumerate(options))]
        content = f"{state}\n\n" + "\n".join([*lines, "Answer with the letter of one option only."])
        tok = lm.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
            ids = list(tok.encode(text, add_special_tokens=False))
        else:
            ids = list(tok.encode(content + "\n\nAnswer:", add_special_tokens=False))
        label_ids = [tok.encode(chr(65 + i), add_special_tokens=False)[-1] for i in range(len(options))]
        lp = lm.next_logprobs(ids)[label_ids].double()
        return [float(p) for p in lp.softmax(-1)], float(lp.exp().sum())

    def _systemone(self, body: dict[str, Any]) -> dict[str, Any]:
        answers, diagnostics = {}, {}
        for qid, q in body["questions"].items():
            names = list(q["criteria"])
            probs, mass = self._read(str(body["state"]), q["instructions"], names)
            top = max(range(len(probs)), key=probs.__getitem__)
            answers[qid] = {
                "type": "choice",
                "choice": names[top],
                "probabilities": dict(zip(names, probs)),
                "confidence": probs[top] * mass,
            }
            diagnostics[qid] = {"label_mass": mass, "argmax_is_label": True}
        return {
            "object": "structured_decision",
            "model": self.server.lm.name,
            "answers": answers,
            "diagnostics": diagnostics,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }

    def _openai_decisions(self, body: dict[str, Any]) -> dict[str, Any]:
        if set(body) - {"model", "input", "questions", "safety_identifier"}:
            raise ValueError(f"unknown fields {sorted(set(body) - {'model', 'input', 'questions'})}")
        answers = []
        for q in body["questions"]:
            values = [c["value"] for c in q["choices"]]
            # vLLM 0.33 renders a choice's value as JSON
            probs, mass = self._read(str(body["input"]), q["instructions"], [json.dumps(v) for v in values])
            top = max(range(len(probs)), key=probs.__getitem__)
            answers.append(
                {
                    "type": "choice",
                    "name": q.get("name"),
                    "choice": values[top],
                    "probabilities": [{"value": v, "probability": p} for v, p in zip(values, probs)],
                    "confidence": probs[top] * mass,
                }
            )
        return {
            "model": self.server.lm.name,
            "answers": answers,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }

    def _sglang_decisions(self, body: dict[str, Any]) -> dict[str, Any]:
        for q in body["questions"]:
            if set(q) - {"id", "type", "question", "options"}:  # SGLang's models forbid other fields
                raise ValueError(f"question fields {sorted(q)}")
        answers = {}
        for q in body["questions"]:
            names = [o["name"] for o in q["options"]]
            probs, mass = self._read(str(body["input"]), q["question"], names)
            answers[q["id"]] = {
                "type": "choice",
                "choice": names[max(range(len(probs)), key=probs.__getitem__)],
                "probabilities": dict(zip(names, probs)),
                "label_mass": mass,
            }
        return {
            "model": self.server.lm.name,
            "prompt_format_version": 1,
            "answers": answers,
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        }

    def _vllm_prompt_logprobs(self, ids: list[int], k: int) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: ``None``, then per prompt token its own entry and the top ``k``."""
        lm = self.server.lm
        rows = lm.prompt_logprobs(ids)  # (T - 1, V)
        out: list[dict[str, Any] | None] = [None]
        for t in range(1, len(ids)):
            row = rows[t - 1]
            # the prompt token, then the top k (k + 1 entries, or k when the prompt token is among them)
            picks = [ids[t], *(i for i in map(int, row.topk(k).indices) if i != ids[t])]
            out.append(
                {
                    str(i): {
                        "logprob": float(row[i]),
                        "rank": int((row > row[i]).sum()) + 1,
                        "decoded_token": lm.tokenizer.decode([i]),
                    }
                    for i in picks
                }
            )
        return out


def make_server(
    lm: LocalModel,
    port: int = 0,
    routes: tuple[str, ...] = ("completions", "sglang"),
    logprobs: bool = True,
    handler: type[Handler] = Handler,
    api_key: str = "",
) -> ThreadingHTTPServer:
    """A server for ``lm`` on ``127.0.0.1:port`` (0: a free port; read ``server.server_port``), not started:
    call ``serve_forever`` (on a thread) and ``shutdown``. ``api_key``: the bearer token every request must
    carry ('' : none)."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    server.lm, server.routes, server.logprobs = lm, set(routes), logprobs  # type: ignore[attr-defined]
    server.api_key = api_key  # type: ignore[attr-defined]
    server.requests, server.count_lock = 0, threading.Lock()  # type: ignore[attr-defined]
    return server


def main() -> None:
    """``python -m judgeloop.testing.openai_compat MODEL --port N``: serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--no-logprobs", action="store_true", help="answer text only")
    parser.add_argument("--api-key-env", default="", help="require the bearer token in this variable")
    args = parser.parse_args()
    key = os.environ.get(args.api_key_env, "") if args.api_key_env else ""
    if args.api_key_env and not key:
        parser.error(
            f"--api-key-env {args.api_key_env}: ${args.api_key_env} is not set; export the key first"
        )
    make_server(LocalModel(args.model), args.port, logprobs=not args.no_logprobs, api_key=key).serve_forever()


if __name__ == "__main__":
    main()
