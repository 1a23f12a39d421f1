//! `s3://BUCKET/PREFIX` volume addresses and the store they name, set up
//! from the standard AWS environment (`AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`,
//! `AWS_ALLOW_HTTP`, ...), as every S3 tool reads it.
use object_store::aws::AmazonS3Builder;
use object_store::ObjectStore;
use std::sync::Arc;

/// A parsed `s3://BUCKET/PREFIX`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Url {
    pub bucket: String,
    pub prefix: String,
}

/// Is this argument an object-store volume rather than a path?
pub fn is_object_url(s: &str) -> bool {
    s.starts_with("s3://")
}

impl S3Url {
    pub fn parse(s: &str) -> Result<S3Url, String> {
        let rest = s
            .strip_prefix("s3://")
            .ok_or_else(|| format!("{s}: not an s3://BUCKET/PREFIX address"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/');
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
        if !bucket_ok {
            return Err(format!(
                "{s}: '{bucket}' is not a bucket name (3 to 63 lower-case letters, digits, '-', '.')"
            ));
        }
        if prefix.is_empty() {
            return Err(format!(
                "{s}: give the volume a prefix in the bucket: s3://{bucket}/NAME"
            ));
        }
        if prefix
            .split('/')
            .any(|p| p.is_empty() || p == "." || p == "..")
        {
            return Err(format!(
                "{s}: the prefix '{prefix}' has an empty, '.' or '..' part"
            ));
        }
        Ok(S3Url {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        })
    }

    /// The bucket's client, configured from the environment.
    pub fn store(&self) -> Result<Arc<dyn ObjectStore>, String> {
        let s3 = AmazonS3Builder::from_env()
            .with_bucket_name(&self.bucket)
            .build()
            .map_err(|e| format!("s3://{}: {e}", self.bucket))?;
        Ok(Arc::new(s3))
    }
}

impl std::fmt::Display for S3Url {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_say_why_not() {
        let u = S3Url::parse("s3://my-bucket/vols/a/").expect("valid");
        assert_eq!(
            (u.bucket.as_str(), u.prefix.as_str()),
            ("my-bucket", "vols/a")
        );
        assert_eq!(u.to_string(), "s3://my-bucket/vols/a");
        assert!(S3Url::parse("s3://my-bucket")
            .unwrap_err()
            .contains("prefix"));
        assert!(S3Url::parse("s3://My_Bucket/x")
            .unwrap_err()
            .contains("bucket"));
        assert!(S3Url::parse("s3://bkt/a//b").is_err());
        assert!(S3Url::parse("s3://bkt/../b").is_err());
        assert!(S3Url::parse("/tmp/x").is_err());
    }
}
