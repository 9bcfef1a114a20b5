"""A harness (standard library only) that goes wrong on purpose (tests/test_harness.py): ``hang`` (calls the endpoint,
starts a grandchild that writes its pid to the file named by argv[2], then both wait forever), ``crash`` (exit 3
after a request), ``garbage`` (a request, then no reward), ``silent`` (a reward without ever calling the endpoint);
``ok`` answers and reports reward 1. ``by-n`` picks one of them from the sample's ``n`` (n % 8: hang, crash,
garbage, silent, ok x4)."""

import json
import os
import subprocess
import sys
import time
import urllib.request

kind = sys.argv[1]
sample = json.loads(os.environ["MOLT_SAMPLE"])
if kind == "by-n":
    kind = ["hang", "crash", "garbage", "silent", "ok", "ok", "ok", "ok"][sample["n"] % 8]
if kind != "silent":  # one chat completion, with the standard library (importing openai costs seconds)
    body = {"model": os.environ["MOLT_MODEL"], "messages": [{"role": "user", "content": sample["question"]}],
            "max_tokens": 8}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps(body).encode(),
                                     {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                      "Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=60).read()
if kind == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(60)"])
    if len(sys.argv) > 2:
        with open(sys.argv[2] + ".tmp", "w") as f:
            f.write(str(child.pid))
        os.rename(sys.argv[2] + ".tmp", sys.argv[2])
    while True:
        time.sleep(60)
if kind == "crash":
    print("about to fail", file=sys.stderr)
    sys.exit(3)
print({"garbage": "no reward here"} if kind == "garbage" else json.dumps({"reward": 1.0}))
