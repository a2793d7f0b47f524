use super::*;

/// A ZMTP 3 greeting (NULL mechanism), as a peer sends it first.
fn greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    if body.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
    out
}

/// A stream of a greeting, a READY command and `messages`, each a list of frame bodies.
fn stream(messages: &[Vec<Vec<u8>>]) -> Vec<u8> {
    let mut out = greeting();
    out.extend(frame(
        FLAG_COMMAND,
        b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB",
    ));
    for m in messages {
        for (i, body) in m.iter().enumerate() {
            let more = if i + 1 < m.len() { FLAG_MORE } else { 0 };
            out.extend(frame(more, body));
        }
    }
    out
}

/// Feeds `bytes` in chunks of `chunk` bytes; the first refusal.
fn feed(limit: u64, bytes: &[u8], chunk: usize) -> Result<(), Refused> {
    let mut check = FrameCheck::new(limit);
    bytes.chunks(chunk).try_for_each(|c| check.feed(c))
}

#[test]
fn well_formed_streams_pass_whatever_the_chunking() {
    let kv = vec![
        b"kv@a".to_vec(),
        7u64.to_be_bytes().to_vec(),
        vec![0x93; 300],
    ];
    let bytes = stream(&[kv.clone(), kv.clone(), vec![vec![]]]);
    for chunk in [1, 2, 7, 64, 65, 300, bytes.len()] {
        assert_eq!(feed(1000, &bytes, chunk), Ok(()), "chunks of {chunk}");
    }
    // Exactly at the limit: the three frames' bodies sum to 4 + 8 + 300.
    assert_eq!(feed(312, &bytes, 5), Ok(()));
}

#[test]
fn announced_sizes_over_the_limit_are_refused_at_the_header() {
    let limit = 1 << 20;
    // The 2^62-byte announcement that made zeromq abort: refused with no body sent.
    let mut huge = greeting();
    huge.push(FLAG_LONG);
    huge.extend_from_slice(&(1u64 << 62).to_be_bytes());
    for chunk in [1, 3, huge.len()] {
        assert_eq!(
            feed(limit, &huge, chunk),
            Err(Refused::TooLarge {
                announced: 1 << 62,
                limit
            })
        );
    }
    // u64::MAX in a command header.
    let mut command = greeting();
    command.push(FLAG_LONG | FLAG_COMMAND);
    command.extend_from_slice(&u64::MAX.to_be_bytes());
    assert!(matches!(
        feed(limit, &command, 9),
        Err(Refused::TooLarge { .. })
    ));
    // Frames each under the limit that sum over it within one message.
    let parts = vec![vec![0u8; 600], vec![0u8; 600]];
    assert_eq!(
        feed(1000, &stream(&[parts]), 64),
        Err(Refused::TooLarge {
            announced: 1200,
            limit: 1000
        })
    );
    // ...but the same sizes as separate messages are fine.
    let separate = vec![vec![vec![0u8; 600]], vec![vec![0u8; 600]]];
    assert_eq!(feed(1000, &stream(&separate), 64), Ok(()));
}

#[test]
fn too_many_frames_and_bad_greetings_are_refused() {
    let many = vec![vec![]; MAX_FRAMES_PER_MESSAGE as usize + 1];
    assert_eq!(feed(1000, &stream(&[many]), 4), Err(Refused::TooManyFrames));
    let ok = vec![vec![]; MAX_FRAMES_PER_MESSAGE as usize];
    assert_eq!(feed(1000, &stream(&[ok.clone(), ok]), 4), Ok(()));
    assert_eq!(feed(1000, b"GET / HTTP/1.1\r\n", 4), Err(Refused::Greeting));
}
