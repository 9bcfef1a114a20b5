#!/bin/bash
grep piano data.txt > answer.txt
