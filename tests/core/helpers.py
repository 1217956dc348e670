from pagedserve.core.request import Request
from pagedserve.sampling_params import SamplingParams


def make_request(req_id: str, prompt_len: int, max_tokens: int = 8, first_token: int = 0) -> Request:
    prompt = [(first_token + i) % 1000 + 3 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(req_id, prompt, params, max_tokens, eos_token_ids=(2,))
