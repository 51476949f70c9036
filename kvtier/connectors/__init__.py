"""Adapters that plug kvtier into serving engines; each maps an engine's offloading API onto TieredCache.

``kvtier.connectors.vllm`` is vLLM's offloading backend (an ``OffloadingSpec`` loaded by vLLM's
``OffloadingConnector``); ``kvtier.connectors.sglang`` is an SGLang HiCache L3 storage backend;
``kvtier.connectors.hf`` gives Hugging Face ``generate()`` prefix reuse. Importing kvtier, or this
package, never imports an engine: an adapter imports its engine only when the engine asks for it.
"""
