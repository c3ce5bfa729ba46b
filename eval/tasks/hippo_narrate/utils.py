"""lmms-eval hooks of the hippo_narrate task: thin names for `hippo.eval.narrate`."""

from hippo.eval.narrate import doc_to_text, doc_to_visual, pooled_accuracy, process_results

__all__ = ["doc_to_text", "doc_to_visual", "pooled_accuracy", "process_results"]
