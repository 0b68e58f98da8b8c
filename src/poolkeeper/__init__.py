"""poolkeeper: an inference gateway for pools of LLM model servers.

It implements the Kubernetes Gateway API Inference Extension around the `InferenceModel` API
(InferencePool, InferenceModel), an Envoy ext_proc Endpoint Picker, and a model-server simulator.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
