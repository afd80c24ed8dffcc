# Hugging Face interop (tokenizers, transformers): the tests that run the real peers in .venv-hf.
astrai_hf_test(hf_tokenizer test_hf_tokenizer.py)
astrai_hf_test(chat_template test_chat_template.py)
astrai_hf_test(hf_model test_hf_model.py)
# astrai-generate greedy on an HF directory = transformers' generate (tokens, stop, log-probs).
astrai_hf_test(hf_generate test_hf_generate.py)
astrai_hf_test(hf_train test_hf_train.py)
