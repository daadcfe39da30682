"""Shared test setup: one torch thread (2 cores contend badly), the hypothesis profiles, and
the markers that split the suite into two tiers.

`make test` runs the fast tier, `pytest -m "not slow and not zoo and not postgres and not
redis and not browser"`, at the `fast` hypothesis profile; `make test-all` runs every test at
the `full` profile (LSA_SLOW=1). Markers are given here, by rule, not in the test files:

- zoo: every test under tests/zoo (exports and verifies third-party architectures);
- postgres / redis: every test that uses, directly or through another fixture, a fixture that
  needs the server (POSTGRES_FIXTURES, REDIS_FIXTURES);
- browser: the tests of BROWSER_MODULES (headless Chromium);
- slow: the tests named in SLOW_TESTS, chosen by measured duration. Every test module keeps at
  least one test out of it (or names in COVERED_BY the fast test that checks its behaviour),
  so the fast tier is a check of every behaviour (tests/test_tiers.py checks that, and that
  every entry names a test).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Before any test imports transformers or timm: they import the registry's torchvision, whose C
# ops do not load against CPU torch (tests/zoo/tv_schemas.py says why this is enough).
from tests.zoo import tv_schemas  # noqa: F401

torch.set_num_threads(1)

# One profile sets every property test's example count; a test that caps its own says why.
# fast: `make test`; full: `make test-all` (LSA_SLOW=1), at least 500 examples per bound kind;
# soak: 10^4 examples, by hand (HYPOTHESIS_PROFILE=soak), not derandomized so that each run
# tries new examples.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("fast", max_examples=20, deadline=None, derandomize=True,
                          suppress_health_check=_QUIET)
settings.register_profile("full", max_examples=500, deadline=None, derandomize=True,
                          suppress_health_check=_QUIET)
settings.register_profile("soak", max_examples=10_000, deadline=None,
                          suppress_health_check=_QUIET)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or (
    "full" if os.environ.get("LSA_SLOW") == "1" else "fast")
settings.load_profile(PROFILE)

POSTGRES_FIXTURES = frozenset({"pg_schemas", "pg_migrated"})
REDIS_FIXTURES = frozenset({"redis_url"})
BROWSER_MODULES = frozenset({"tests/service/test_docs_browser.py"})
ZOO_DIR = "tests/zoo/"

# Slow: one run of the test (all its parameters, at the fast profile) measured above about 10 s
# on 2 cores shared with other work (--durations), except where it is its module's cheapest
# test or a soundness property the fast tier must keep. Modules, then test names.
_SLOW = {
    "tests/service/test_crash_recovery.py": (
        "test_crash_recovery_server_killed_mid_job_finishes_once",
    ),
    "tests/service/test_load.py": (
        "test_load_cached_and_uncached_bound_all_answer_200",
        "test_load_uploaded_onnx_is_not_compared_with_onnxruntime_again",
    ),
    "tests/service/test_openapi.py": (
        "test_openapi_fuzz_no_server_errors",
    ),
    "tests/service/test_robustness_api.py": (
        "test_certified_accuracy_job_decides_in_worker_processes_and_a_cancel_ends_them",
        "test_robustness_certificate_is_a_job_then_cached_and_verifies",
        "test_robustness_certificate_of_a_job_is_stored_once",
        "test_robustness_job_cancelled_mid_bisection_stores_nothing",
        "test_robustness_jobs_for_the_same_radii_compute_them_once",
        "test_robustness_radii_are_stored_once_and_a_fresh_server_signs_from_them",
    ),
    "tests/service/test_robustness_budget.py": (
        "test_robustness_job_with_a_budget_signs_the_radius_found_in_time",
    ),
    "tests/service/test_set_pool.py": (
        "test_decide_all_in_worker_processes_gives_the_serial_verdicts",
    ),
    "tests/test_affine_fast.py": (
        "test_fast_walk_gives_the_reference_margins_and_holds_against_pgd",
    ),
    "tests/test_at_radius.py": (
        "test_decide_agrees_with_the_radius_search",
    ),
    "tests/test_ci_docs.py": (
        "test_ci_docs_github_workflow_commands_run",
        "test_ci_docs_gitlab_job_commands_run_against_a_server",
        "test_ci_docs_robustness_gate_command_runs",
    ),
    "tests/test_cli_robustness_reports.py": (
        "test_counterexamples_flip_the_library_model_on_images",
        "test_robustness_counterexample_of_one_input_and_none_found",
        "test_robustness_gate_signs_a_certificate_here_that_verify_recomputes",
        "test_robustness_no_sweep_leaves_the_sweeps_inputs_unknown_and_its_certificate_says_so",
    ),
    "tests/test_cli_verify.py": (
        "test_verify_recompute_robustness_reaches_the_same_radius",
        "test_verify_recompute_robustness_rejects_a_signed_but_wrong_radius",
        "test_verify_recompute_robustness_rejects_an_inconsistent_verdict",
    ),
    "tests/test_e2e_server.py": (
        "test_e2e_certify_server_fails_above_threshold_with_junit",
        "test_e2e_certify_server_passes_and_the_report_matches_the_api",
        "test_e2e_robustness_set_through_the_server_signs_the_local_statuses",
        "test_e2e_verify_server_key_and_recompute",
    ),
    "tests/test_empirical_soundness.py": (
        "test_soundness_tight_scalar_l2",
    ),
    "tests/test_forward_ball.py": (
        "test_local_bound_on_an_x_transformers_classifier_is_tight_with_the_balls",
    ),
    "tests/test_local_adjoint.py": (
        "test_adjoint_and_tangent_graphs_through_attention_masks",
        "test_adjoint_bound_never_below_the_exact_gradient_norm",
        "test_certify_local_takes_the_adjoint_bound_where_smaller",
        "test_robustness_mlp_inf_radius_is_at_least_0_6_of_the_attack",
        "test_sweep_constants_are_the_smaller_of_adjoint_and_enclosure",
    ),
    "tests/test_local_affine.py": (
        "test_affine_margin_lower_bounds_hold_against_pgd",
        "test_affine_walk_encloses_every_tensor_of_the_issue_classifiers",
        "test_affine_walk_through_attention_masks_encloses_every_tensor",
    ),
    "tests/test_local_conv.py": (
        "test_affine_margins_of_a_vit_on_pixels_hold_against_pgd",
        "test_local_conv_depthwise_token_conv_block_certified_locally",
        "test_local_conv_pixel_classifier_robustness_radius",
        "test_local_conv_vit_on_pixels_certified_between_lower_and_global",
    ),
    "tests/test_local_engine.py": (
        "test_local_bound_is_never_below_jacobians_in_the_ball",
        "test_local_bound_on_hf_gpt2_with_causal_mask",
        "test_local_bound_tends_to_the_centre_jacobian",
        "test_local_structured_norms_hold_at_points_of_the_ball",
        "test_local_value_ranges_hold_for_every_tensor",
    ),
    "tests/test_local_opnorm.py": (
        "test_local_two_norm_bound_holds_against_projected_ascent",
    ),
    "tests/test_local_quad.py": (
        "test_quad_eig_robustness_radius_of_the_one_layer_transformer_on_the_two_ball",
        "test_quad_lockstep_enclosure_holds_against_projected_ascent",
        "test_quad_robustness_radius_of_the_one_layer_transformer",
        "test_quad_walk_encloses_every_tensor_of_the_issue_transformers",
    ),
    "tests/test_local_rules_more.py": (
        "test_local_rules_more_bound_is_never_below_jacobians_in_the_ball",
    ),
    "tests/test_local_second.py": (
        "test_second_rows_hold_on_torch_mlps",
        "test_second_rule_bounds_each_term_at_points_of_the_ball",
        "test_unfixed_factored_bounds_the_unfixed_entries_changes",
    ),
    "tests/test_local_signed.py": (
        "test_signed_rows_hold_on_a_transformer",
    ),
    "tests/test_local_tangent.py": (
        "test_certify_local_takes_the_tangent_bound_where_smaller",
        "test_tangent_bound_never_below_the_exact_row_norms",
        "test_tangent_bound_tends_to_the_centre_jacobian",
        "test_tangent_bound_with_second_order_symbols_is_tighter_on_attention",
    ),
    "tests/test_onnx_bounds.py": (
        "test_onnx_attention_certified_upper_dominates_lower_bound",
    ),
    "tests/test_onnx_conv.py": (
        "test_onnx_conv_patch_embedding_bound_is_its_kernel_norm",
        "test_onnx_conv_sequence_conv_block_certified_above_jacobian",
    ),
    "tests/test_onnx_layouts.py": (
        "test_onnx_seq_first_l2_certified_above_jacobian",
    ),
    "tests/test_onnx_masks.py": (
        "test_masked_fill_attention_is_certified_with_the_replaced_bound",
        "test_masked_fill_that_is_not_a_constant_mask_is_not_certified",
        "test_replaced_dp_bound_dominates_projected_gradient_ascent",
        "test_sdpa_nan_guard_is_read_as_the_identity",
    ),
    "tests/test_onnx_models.py": (
        "test_causal_encoder_layer_is_recognised_whatever_the_mask_encoding",
        "test_export_l2_transformer_matches_ort_and_native_bound",
        "test_multihead_attention_is_recognised_as_dot_product",
        "test_sequence_first_export_is_analysed_like_batch_first",
        "test_transformer_encoder_layer_bounds_are_sound",
    ),
    "tests/test_onnx_recognition.py": (
        "test_onnx_recognition_encoder_layer_on_2d_input",
        "test_onnx_recognition_l2_forms_certify_theorem_bound",
        "test_onnx_recognition_sdpa_both_exporters_agree",
        "test_onnx_recognition_untied_l2_is_refused_with_a_reason",
    ),
    "tests/test_onnx_recognition_cls.py": (
        "test_onnx_recognition_cls_l2_bound_uses_the_attention_token_count",
    ),
    "tests/test_onnx_recognition_einsum.py": (
        "test_onnx_recognition_x_transformers_encoder_and_decoder",
    ),
    "tests/test_onnx_recognition_hf.py": (
        "test_onnx_recognition_gpt2_inputs_embeds_both_exporters_agree",
        "test_onnx_recognition_token_id_models_start_at_the_lookup",
    ),
    "tests/test_onnx_rotary.py": (
        "test_onnx_rotary_block_certified_above_jacobian",
        "test_onnx_rotary_key_bias_certified_with_the_key_bias_counted",
    ),
    "tests/test_robustness.py": (
        "test_robustness_certified_radius_holds_and_is_below_attack",
        "test_robustness_pgd_finds_no_flip_inside_the_certified_ball",
        "test_robustness_relu_mlp_by_the_affine_route",
        "test_robustness_skips_the_adjoint_sweep_after_a_cut_off_one",
        "test_robustness_takes_the_larger_route_and_names_it",
        "test_sweep_enclosure_keeps_the_rows_and_margins_of_the_plain_call",
        "test_sweep_near_a_decision_boundary_takes_few_pieces_and_stops_at_the_attack",
    ),
    "tests/test_operators_e2e.py": (
        "test_robustness_radius_has_no_flip_inside",
    ),
    "tests/test_time_budget.py": (
        "test_a_budget_stops_the_radius_search_at_a_prefix",
        "test_cli_budget_in_json_and_text",
        "test_tiny_and_generous_budgets_on_the_clock",
    ),
}
SLOW_TESTS = frozenset(f"{module}::{name}" for module, names in _SLOW.items() for name in names)

# A module whose every test is slow, and the fast test that checks its behaviour instead.
COVERED_BY = {
    # the real server SIGKILLed mid-job; the fast test reruns a job the database says crashed
    "tests/service/test_crash_recovery.py":
        "tests/service/test_robustness_api.py::"
        "test_robustness_job_rerun_after_a_crash_returns_its_certificate",
}


def test_id(nodeid: str) -> str:
    """`file::name` of a collected item: its parameters dropped."""
    return nodeid.split("[", 1)[0]


def markers_for(nodeid: str, fixturenames: list[str] | tuple[str, ...]) -> list[str]:
    """The tier markers of the test `nodeid` that uses `fixturenames`."""
    path = nodeid.split("::", 1)[0]
    names = set(fixturenames)
    found = []
    if path.startswith(ZOO_DIR):
        found.append("zoo")
    if names & POSTGRES_FIXTURES:
        found.append("postgres")
    if names & REDIS_FIXTURES:
        found.append("redis")
    if path in BROWSER_MODULES:
        found.append("browser")
    if test_id(nodeid) in SLOW_TESTS:
        found.append("slow")
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        for name in markers_for(item.nodeid, getattr(item, "fixturenames", ())):
            item.add_marker(name)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
