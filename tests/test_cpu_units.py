"""zfunc.ops.cpu.units: the native half-precision matrix units read from a CPU's feature flags."""
from zfunc.ops.cpu import units as cpu_units

X86_ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl avx512_bf16 avx512_vnni f16c
processor\t: 1
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl avx512_bf16 avx512_vnni f16c
"""
X86_SAPPHIRE_RAPIDS = "flags\t\t: avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8 amx_fp16\n"
X86_AVX2 = "flags\t\t: fpu sse2 avx avx2 fma f16c\n"
ARM_NEOVERSE_V1 = "processor\t: 0\nFeatures\t: fp asimd fphp asimdhp sve i8mm bf16 svebf16\nCPU part\t: 0xd40\n"


def test_parse_flags_reads_x86_flags_and_aarch64_features():
    assert {"avx512_bf16", "f16c"} <= cpu_units.parse_flags(X86_ZEN4)
    assert {"bf16", "asimdhp"} <= cpu_units.parse_flags(ARM_NEOVERSE_V1)
    assert "0xd40" not in cpu_units.parse_flags(ARM_NEOVERSE_V1)  # other fields are not flags
    assert cpu_units.parse_flags("") == frozenset()


def test_native_units_are_the_matrix_instructions_the_flags_hold():
    flags = cpu_units.parse_flags
    assert cpu_units.native_units("bf16", flags(X86_ZEN4)) == ("avx512_bf16",)
    assert cpu_units.native_units("fp16", flags(X86_ZEN4)) == ()  # f16c converts, it does not multiply
    assert cpu_units.native_units("bf16", flags(X86_SAPPHIRE_RAPIDS)) == ("amx_bf16", "avx512_bf16")
    assert cpu_units.native_units("fp16", flags(X86_SAPPHIRE_RAPIDS)) == ("amx_fp16", "avx512_fp16")
    assert cpu_units.native_units("bf16", flags(X86_AVX2)) == cpu_units.native_units("fp16", flags(X86_AVX2)) == ()
    assert cpu_units.native_units("bf16", flags(ARM_NEOVERSE_V1)) == ("bf16",)
    assert cpu_units.native_units("fp32", flags(X86_AVX2)) == ()


def test_an_unreadable_cpuinfo_means_no_native_unit(tmp_path):
    assert cpu_units.cpu_flags(str(tmp_path / "no-cpuinfo")) == frozenset()
    path = tmp_path / "cpuinfo"
    path.write_text(X86_AVX2)
    assert "avx2" in cpu_units.cpu_flags(str(path))
