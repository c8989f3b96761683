"""One agent in its own OS process: ``python -m kvrelay.workflows.worker --model M --name A [--store URL]``.

Driven over stdin/stdout, one JSON object per line (``workflows.process_executor`` is the driver).
The worker loads its model itself (any ``load_model`` name; ``tiny:ARCH:SEED`` rebuilds the same
random model in every process) and opens the store itself: payloads never cross the pipe, only
their keys. With signing keys (``--keys-file``, else ``$KVRELAY_KEYS``; ``kv.sign``) it signs every
payload it writes with its key for its own name and refuses any payload not signed by one of them. Requests and replies::

    {"op": "reset", "verify": null | {"k", "full", "seed", "codec"}, "max_bytes": null | N}
                                                      -> {"ok": true}          a fresh Agent (round 0)
    {"op": "context_ids", "context": STR}             -> {"ids": [int]}
    {"op": "turn", "prompt": STR, "base": [int], "cache": KEY | null, "layout": STR,
     "max_new_tokens": N, "min_new_tokens": N, "want_payload": BOOL, "out_key": KEY, "codec": NAME}
                                                      -> {"turn": TurnOut.to_json(), "payload": KEY | null}
    {"op": "quit"}                                    -> (exits)

The first line it writes is ``{"ready": true, "fingerprint": ...}``; a failed request answers
``{"error": TYPE, "message": STR, "refused": BOOL}`` (``refused``: the receiver refused the relayed
payload, or the store lost it or could not be read) and the worker keeps serving. Anything else the libraries
print goes to stderr, so stdout carries the protocol only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvrelay.core.errors import OverBudget, PayloadError, PayloadNotFound, StoreError

STORE_ENV = "KVRELAY_STORE_URL"
# the receiver refused a relayed payload (untrusted, or over its byte budget), or the store lost it or could
# not be read (after its retries)
REFUSALS = (PayloadError, OverBudget, PayloadNotFound, StoreError)


def _serve(args, send) -> None:
    import torch

    from kvrelay.agents.agent import Agent
    from kvrelay.agents.verify import VerifySpec
    from kvrelay.kv.sign import keyring_from
    from kvrelay.models.loader import load_model
    from kvrelay.transport.budget import ByteBudget
    from kvrelay.transport.stores import open_store
    from kvrelay.workflows.turn import store_turn

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, engine=args.engine)
    store = open_store(args.store or os.environ.get(STORE_ENV, ""))
    keyring = keyring_from(args.keys_file)  # else $KVRELAY_KEYS; empty: nothing signed or asked for
    signer = keyring.signer(args.name)

    def fresh(verify: dict | None = None, max_bytes: int | None = None) -> Agent:
        spec = VerifySpec(**verify) if verify else None
        budget = ByteBudget(max_bytes) if max_bytes is not None else None
        return Agent(lm, args.name, args.role, max_new_tokens=args.max_new_tokens, verify=spec, budget=budget)

    agent = fresh()
    send({"ready": True, "fingerprint": lm.identity.fingerprint, "pid": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "quit":
                return
            if req["op"] == "reset":
                agent = fresh(req.get("verify"), req.get("max_bytes"))
                send({"ok": True})
            elif req["op"] == "context_ids":
                send({"ids": agent.encode(agent.fmt.user(req["context"]))})
            elif req["op"] == "turn":
                send(_turn(req, agent, store, store_turn, keyring, signer))
            else:
                raise ValueError(f"unknown op {req['op']!r}; expected reset, context_ids, turn or quit")
        except Exception as e:  # reported to the driver, which raises WorkerError
            send({"error": type(e).__name__, "message": str(e), "refused": isinstance(e, REFUSALS)})


TURN_FIELDS = ("prompt", "base", "cache", "layout", "max_new_tokens", "min_new_tokens", "want_payload", "out_key",
               "codec")


def _turn(req: dict, agent, store, store_turn, keyring=None, signer=None) -> dict:
    missing = [f for f in TURN_FIELDS if f not in req]
    if missing:  # every field is required: a payload is never written with a codec the driver did not choose
        raise ValueError(f"turn request lacks {', '.join(missing)}; expected every one of {', '.join(TURN_FIELDS)}")
    out = store_turn(agent, store, req["prompt"], req["base"], req["cache"], req["layout"], codec=req["codec"],
                     out_key=req["out_key"], max_new_tokens=req["max_new_tokens"],
                     min_new_tokens=req["min_new_tokens"], want_payload=req["want_payload"], keys=keyring,
                     signer=signer)
    return {"turn": out.to_json(), "payload": out.payload}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvrelay.workflows.worker", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="any load_model name (zoo, folder, tiny:ARCH:SEED)")
    ap.add_argument("--name", required=True, help="the agent's name")
    ap.add_argument("--role", default="", help="the agent's role prompt")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--store", default=None, help="store URL shared with the other agents (file:// or redis://); "
                    f"default ${STORE_ENV}, which keeps a Redis password off the command line")
    ap.add_argument("--keys-file", default=None, help="signing keys (kvrelay.kv.sign key lines); default $KVRELAY_KEYS. "
                    "With keys, the worker signs what it writes and refuses payloads not signed by one of them")
    # the codec of each payload it writes comes with each turn request (kv.codecs names)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--engine", default="fp32", help="kernel mode (models.engine); agents of one workflow share it")
    args = ap.parse_args(argv)
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol channel
    os.dup2(2, 1)  # everything else written to stdout lands on stderr
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")

    _serve(args, send)


if __name__ == "__main__":  # pragma: no cover - run as a process
    main()
