//! What this CPU issues of the bf16 decode kernel's loop over block pairs
//! (`models/src/kernels/narrow/bf16.rs`), without memory in the way: per 64 weights and row of
//! `x`, two `vdpbf16ps` and the block scales' `vfmadd231ps`, over 16 independent sums (a 4 x 4
//! tile's). Prints each pattern's time per step in units of one 512-bit fused multiply-add
//! (measured first, 16 independent chains), so that a step of 3.0 means the three instructions
//! take one issue slot each (BENCHMARKS.md, "The loop over block pairs against a probe of its
//! instructions"). Usage: `cargo run --release -p scd-models --example pair_loop_probe`; needs
//! AVX-512 BF16.

#[cfg(target_arch = "x86_64")]
mod probe {
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::time::Instant;

    /// Steps timed per pattern.
    const STEPS: usize = 200_000_000;

    /// Hides `v`'s value from the compiler, so that a product it feeds is computed again.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn opaque(v: __m512i) -> __m512i {
        let mut v = v;
        // SAFETY: an empty instruction that leaves the register as it is.
        unsafe { asm!("/* {0} */", inout(zmm_reg) v, options(pure, nomem, nostack)) };
        v
    }

    fn bh(v: __m512i) -> __m512bh {
        // SAFETY: the same 512 bits.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// Seconds per step of 16 independent multiply-adds.
    #[target_feature(enable = "avx512f")]
    fn fma() -> f64 {
        let mut acc = [_mm512_set1_ps(0.0); 16];
        let (mut x, d) = (_mm512_set1_epi32(0x3f80_0000), _mm512_set1_ps(1e-9));
        let t = Instant::now();
        for _ in 0..STEPS / 16 {
            for a in &mut acc {
                *a = _mm512_fmadd_ps(_mm512_castsi512_ps(x), d, *a);
            }
            x = opaque(x);
        }
        std::hint::black_box(acc);
        t.elapsed().as_secs_f64() / STEPS as f64
    }

    /// Seconds per step of the kernel's loop: `scaled` adds the scales' multiply-add after the
    /// two products (else they sum straight into the accumulator).
    #[target_feature(enable = "avx512f,avx512bf16")]
    fn step(scaled: bool) -> f64 {
        let mut acc = [_mm512_set1_ps(0.0); 16];
        let (w, mut x) = (
            bh(_mm512_set1_epi32(0x3f80_3f80)),
            _mm512_set1_epi32(0x3f80_3f80),
        );
        let d = _mm512_set1_ps(1e-9);
        let t = Instant::now();
        for _ in 0..STEPS / 16 {
            for a in &mut acc {
                if scaled {
                    let dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), w, bh(x));
                    let dot = _mm512_dpbf16_ps(dot, w, bh(x));
                    *a = _mm512_fmadd_ps(dot, d, *a);
                } else {
                    *a = _mm512_dpbf16_ps(*a, w, bh(x));
                    *a = _mm512_dpbf16_ps(*a, w, bh(x));
                }
                x = opaque(x);
            }
        }
        std::hint::black_box(acc);
        t.elapsed().as_secs_f64() / STEPS as f64
    }

    /// Seconds per step of the kernel's loop with a weight row's 32 bytes of nibbles widened to
    /// bf16 and its scales spread (as `bf16::widen` and the kernel do) once per `N` rows of `x`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    fn widened<const N: usize>(weights: &[u8]) -> f64 {
        let mut acc = [_mm512_set1_ps(0.0); 16];
        let mut x = _mm512_set1_epi32(0x3f80_3f80);
        let (ds, mut idx, two) = (
            _mm512_set1_ps(1e-9),
            _mm512_set1_epi32(0),
            _mm512_set1_epi32(2),
        );
        let magic = _mm512_set1_epi16(0x4300);
        let t = Instant::now();
        for i in 0..STEPS / 16 {
            for r in 0..16 / N {
                let at = (i * 128 + r * 32) % (weights.len() - 32);
                // SAFETY: 32 bytes from `at`, inside `weights`.
                let w = _mm512_cvtepu8_epi16(unsafe {
                    _mm256_loadu_si256(weights.as_ptr().add(at).cast())
                });
                let lo = _mm512_ternarylogic_epi32::<0xEA>(w, _mm512_set1_epi16(0x000F), magic);
                let hi = _mm512_or_si512(_mm512_srli_epi16::<4>(w), magic);
                let (w0, w1) = (
                    bh(_mm512_shuffle_i64x2::<0x44>(lo, hi)),
                    bh(_mm512_shuffle_i64x2::<0xEE>(lo, hi)),
                );
                let d = _mm512_permutexvar_ps(idx, ds);
                for a in &mut acc[r * N..(r + 1) * N] {
                    let dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, bh(x));
                    let dot = _mm512_dpbf16_ps(dot, w1, bh(x));
                    *a = _mm512_fmadd_ps(dot, d, *a);
                    x = opaque(x);
                }
            }
            idx = _mm512_and_si512(_mm512_add_epi32(idx, two), _mm512_set1_epi32(15));
        }
        std::hint::black_box(acc);
        t.elapsed().as_secs_f64() / STEPS as f64
    }

    /// A timed pattern over a buffer of weight bytes.
    type Pattern = unsafe fn(&[u8]) -> f64;

    pub fn run() -> Result<(), String> {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx512f") && has!("avx512bw") && has!("avx512bf16")) {
            return Err("this probe needs AVX-512 F, BW and BF16".into());
        }
        let weights: Vec<u8> = (0..4096u32).map(|i| (i * 37 % 251) as u8).collect();
        // SAFETY: the features were detected above.
        unsafe {
            let unit = fma();
            println!(
                "one 512-bit multiply-add: {:.3} ns ({:.2} G per second and core)",
                unit * 1e9,
                1e-9 / unit
            );
            let row = |what: &str, s: f64| println!("{what:62} {:5.2}", s / unit);
            println!("{:62} {:>5}", "per step, in multiply-adds' time", "");
            row("two products and the scale's multiply-add", step(true));
            row("the two products alone, into the accumulator", step(false));
            let per: [(usize, Pattern); 5] = [
                (1, widened::<1>),
                (2, widened::<2>),
                (4, widened::<4>),
                (8, widened::<8>),
                (16, widened::<16>),
            ];
            for (n, f) in per {
                row(
                    &format!("the step, a weight row widened per {n} rows of x"),
                    f(&weights),
                );
            }
        }
        Ok(())
    }
}

fn main() -> Result<(), String> {
    #[cfg(target_arch = "x86_64")]
    return probe::run();
    #[cfg(not(target_arch = "x86_64"))]
    Err("this probe is for x86-64 with AVX-512 BF16".into())
}
