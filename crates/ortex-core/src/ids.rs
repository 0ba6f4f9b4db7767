//! Newtypes for the integers that name things, so a block id never passes for a token.

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(pub u32);

        impl $name {
            pub const fn get(self) -> u32 {
                self.0
            }
        }
    };
}

id_type!(
    /// Engine-wide request id: starts at 1, grows by 1, never reused. 0 means "no request".
    RequestId
);
id_type!(
    /// Request-local turn id: starts at 1, grows by 1. 0 means "no turn".
    TurnId
);
id_type!(
    /// Index of a block in the KV block pool.
    BlockId
);
