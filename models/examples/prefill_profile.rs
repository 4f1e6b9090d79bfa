//! A bare f32 prefill loop for profilers (`perf record`): load the model, run a prefill of T
//! tokens N times, print the time of each. Usage: prefill_profile GGUF [T] [N]
use scd_models::{Input, Llama, LogitsWanted};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: prefill_profile GGUF [T] [N]")?;
    let t: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1024);
    let n: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(3);
    let model = Llama::from_gguf(&path)?;
    let vocab = model.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..t as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    for _ in 0..n {
        let start = Instant::now();
        model.forward(Input::new(&tokens).logits(LogitsWanted::Last))?;
        println!("prefill T={t}: {:.3} s", start.elapsed().as_secs_f64());
    }
    Ok(())
}
