"""ling2.data: Megatron-LM token data.

indexed (.bin/.idx reader and writer) < gpt_index (GPT sample indices) < blend (weighted
blends, data_path parsing) < pipeline (grain batches for the trainer).
"""
