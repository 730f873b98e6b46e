"""The core of mepo-stream: the model and its online learner in pure torch, and the stream contract that the
producer and the server share.

* Model and learning (torch and timm; no Kafka, HTTP or river): backbones and bundles, prompts, alignment,
  the host methods, classifier heads, the online learner, the Si-Blurry sampler, meta refinement and the
  offline evaluation.
* The stream contract: the record format (``records``) and how both sides reach Kafka (``kafka``: client and
  security options, topic creation, partition keys). ``producers/`` and ``server/`` never import each other,
  so what they must agree on lives here; kafka-python is imported only inside the functions that talk to a
  cluster.

Dependencies point one way: ``offline/``, ``producers/``, ``server/`` and ``benchmarks/`` import this package,
and it imports none of them (``cli`` finds their commands through entry points).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mepo-stream")  # pyproject.toml's, the one place it is written
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
